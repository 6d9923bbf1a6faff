"""Bad experiment files: `testbed run` refuses each with exit code 2 and a message naming the file, the line,
the field and the problem, before anything is built (no output directory, no namespaces). Pure: runs without
root. The same loader reads topology files (tests/test_topo_validation.py)."""

from __future__ import annotations

import pytest

from conftest import ROOT, tb_cli
from testbed.experiments.spec import Experiment
from testbed.topology.topo import TopologyError
from testbed.topology.yamlfile import InputError, parse_yaml

PAIR = ROOT / "topologies" / "pair.yaml"

GOOD = f"""name: check
model: tiny
steps: 4
topologies:
  ddp: {PAIR}
grid:
  mode: [ddp]
  ber: [0, 1e-5]
train:
  batch_size: 4
"""


def write(tmp_path, text: str, name: str = "exp.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def refused(tmp_path, path) -> str:
    """Run `testbed run` on the file; it must exit 2 without a traceback and without creating --out."""
    out = tmp_path / "out"
    r = tb_cli("run", str(path), "--out", str(out))
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr
    assert not out.exists()
    return r.stderr.strip()


def test_duplicate_key_exits_2_naming_the_line(tmp_path):
    path = write(tmp_path, GOOD.replace("steps: 4\n", "steps: 4\nsteps: 40\n"))
    msg = refused(tmp_path, path)
    assert msg == f"{path}:4: not valid YAML (column 1): duplicate key 'steps' (first on line 3)"


def test_bad_field_value_exits_2_naming_the_line(tmp_path):
    path = write(tmp_path, GOOD.replace("ber: [0, 1e-5]", "ber: [0, 0.9]"))
    msg = refused(tmp_path, path)
    assert msg.startswith(f"{path}:8: grid.ber[1]: "), msg
    assert "[0, 0.5]" in msg


def test_every_problem_is_reported_in_file_order(tmp_path):
    text = GOOD.replace("steps: 4", "steps: 0").replace("batch_size: 4", "batch_size: 4\n  bacth: 2")
    with pytest.raises(InputError) as e:
        Experiment.load(write(tmp_path, text))
    lines = str(e.value).splitlines()
    assert [line.split(": ")[1] for line in lines] == ["steps", "train.bacth"]
    assert lines[0].startswith(f"{tmp_path / 'exp.yaml'}:3: steps: ")
    assert lines[1].endswith("train.bacth: unknown key (check its spelling and the documented fields)")


def test_missing_key_names_the_mapping_that_lacks_it(tmp_path):
    with pytest.raises(InputError) as e:
        Experiment.load(write(tmp_path, GOOD.replace("  mode: [ddp]\n", "")))
    assert str(e.value) == f"{tmp_path / 'exp.yaml'}:6: grid.mode: required field is missing"


def test_topology_problems_name_both_files(tmp_path):
    topo = write(tmp_path, 'name: t\ntopology:\n  nodes: {h1: {}, h2: {}}\n  links:\n'
                           '    - endpoints: ["h1:eth1", "h2:eth1"]\n      ber: 0.9\n', "topo.yaml")
    text = GOOD.replace(str(PAIR), str(topo)).replace("mode: [ddp]", "mode: [ddp, pp]")
    with pytest.raises(TopologyError) as e:  # TopologyError is the loader's InputError: one exit code for both
        Experiment.load(write(tmp_path, text))
    assert str(e.value).splitlines() == [
        f"{tmp_path / 'exp.yaml'}:4: topologies.pp: grid runs mode pp but names no topology for it",
        f"{tmp_path / 'exp.yaml'}:5: topologies.ddp: {topo}:6: topology.links[0].ber: must lie in [0, 0.5], got 0.9"]


def test_latency_section_is_checked_before_training(tmp_path):
    text = GOOD + f"latency: {{topology: {PAIR}, link: h1-h9}}\n"
    with pytest.raises(InputError) as e:
        Experiment.load(write(tmp_path, text))
    assert str(e.value).startswith(f"{tmp_path / 'exp.yaml'}:11: latency.link: topology 'pair' has no link 'h1-h9'")


@pytest.mark.parametrize("text,words", [
    ("", "the file is empty"),
    ("- name: check\n", ":1: the file must hold a mapping"),
    ("name: [check\n", "not valid YAML"),
])
def test_files_that_are_no_experiment(tmp_path, text, words):
    with pytest.raises(InputError) as e:
        Experiment.load(write(tmp_path, text))
    assert words in str(e.value)


def test_unreadable_file(tmp_path):
    with pytest.raises(InputError, match="cannot read file"):
        Experiment.load(tmp_path / "missing.yaml")


def test_good_file_loads(tmp_path):
    exp = Experiment.load(write(tmp_path, GOOD))
    assert [p.id for p in exp.points()] == ["ddp-ber0-tensor-fix-s1", "ddp-ber1e-5-tensor-fix-s1"]


def test_line_index_covers_nested_paths():
    data, lines = parse_yaml("a:\n  b:\n    - x: 1\n    - {x: 2, y: 3}\nc: [1, 2]\n", "f.yaml")
    assert data == {"a": {"b": [{"x": 1}, {"x": 2, "y": 3}]}, "c": [1, 2]}
    assert lines == {"": 1, "a": 1, "a.b": 2, "a.b[0]": 3, "a.b[0].x": 3, "a.b[1]": 4, "a.b[1].x": 4,
                     "a.b[1].y": 4, "c": 5, "c[0]": 5, "c[1]": 5}
    assert InputError("f.yaml", [("a.b[1].z", "unknown key")], lines).render() == "f.yaml:4: a.b[1].z: unknown key"


# --- recipes and tokens per step -------------------------------------------------------------------------------

RECIPES = GOOD.replace("  mode: [ddp]\n", "  recipe: [default, sanitize, protect, bf16]\n  mode: [ddp, pp]\n").replace(
    "  ddp: " + str(PAIR), f"  ddp: {PAIR}\n  pp: {PAIR}") + """  lr: 0.001
recipes:
  sanitize: {train: {guard: sanitize, sanitize_threshold: 100.0}}
  protect: {link: {protect: [sign, exponent], protected_ber: 1e-7}}
  bf16: {description: bf16 on the wire, train: {wire_dtype: bf16}}
"""


def test_recipes_merge_over_train_and_name_their_points(tmp_path):
    exp = Experiment.load(write(tmp_path, RECIPES))
    ids = [p.id for p in exp.points()]
    assert ids[:2] == ["ddp-ber0-tensor-fix-s1", "ddp-ber0-tensor-fix-sanitize-s1"]  # baselines first
    assert "ddp-ber1e-5-tensor-fix-s1" in ids and "pp-ber1e-5-tensor-fix-bf16-s1" in ids and len(ids) == 16
    point = next(p for p in exp.points() if p.id == "ddp-ber1e-5-tensor-fix-sanitize-s1")
    assert point.baseline.id == "ddp-ber0-tensor-fix-sanitize-s1" and point.params()["recipe"] == "sanitize"
    base = exp.train_settings(next(p for p in exp.points() if p.recipe == "default"))
    cfg = exp.train_settings(point)
    assert (cfg.guard, cfg.sanitize_threshold, cfg.lr, cfg.batch_size) == ("sanitize", 100.0, 0.001, 4)
    # only the recipe's own settings differ from the file's train:
    assert {k for k in vars(cfg) if getattr(cfg, k) != getattr(base, k)} == {"guard", "sanitize_threshold"}
    protect = [p for p in exp.points() if p.recipe == "protect"]
    assert exp.train_settings(protect[0]) == base
    clean, noisy = (next(p for p in protect if p.mode == "ddp" and p.ber == b) for b in (0, 1e-5))
    assert exp.link_settings(noisy) == {"protect": ["sign", "exponent"], "protected_ber": 1e-7, "element": "fp32"}
    assert exp.link_settings(clean)["protected_ber"] == 0.0  # a clean baseline has no residual errors either
    bf16 = next(p for p in exp.points() if p.recipe == "bf16")
    assert exp.link_settings(bf16) == {"element": "bf16"} and exp.link_settings(point) == {}


def test_fingerprints_are_per_recipe_and_unchanged_without_recipes(tmp_path):
    import hashlib
    import json

    from testbed.experiments.spec import LATER_DEFAULTS

    exp = Experiment.load(write(tmp_path, RECIPES, "recipes.yaml"))
    more = RECIPES.replace("  bf16:", "  fp16: {train: {wire_dtype: fp16}}\n  bf16:")
    one_more = Experiment.load(write(tmp_path, more, "more.yaml"))
    fps = {r: exp.fingerprint(None, r) for r in ("default", "sanitize", "protect", "bf16")}
    assert len(set(fps.values())) == 4
    # adding a recipe does not invalidate the points of the others
    assert all(one_more.fingerprint(None, r) == fp for r, fp in fps.items())
    # the default recipe hashes like the same file without recipes, and that as it did before recipes existed
    plain = Experiment.load(write(tmp_path, RECIPES.split("recipes:")[0].replace(
        "recipe: [default, sanitize, protect, bf16]", "recipe: [default]"), "plain.yaml"))
    assert plain.fingerprint() == fps["default"]
    d = plain.spec.model_dump(exclude={"grid", "latency", "description", "point_timeout", "topologies", "recipes",
                                       "tokens_per_step", "fault", "tolerance", "resources", "reuse"})
    for k in LATER_DEFAULTS:  # settings added since: absent from the hash at their defaults
        assert d["train"].pop(k) == LATER_DEFAULTS[k]
    d["topologies"] = {m: hashlib.sha256(PAIR.read_bytes()).hexdigest() for m in ("ddp", "pp")}
    d["runtime"] = "netns"
    assert plain.fingerprint() == hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


@pytest.mark.parametrize("name", ["thresholds", "scaling", "resync", "clipdrift", "clipdrift-pp", "linklayer",
                                  "paper-regime"])
def test_shipped_results_still_resume_against_their_experiment_files(name):
    """docs/results/NAME was run from experiments/NAME.yaml: every row's fingerprint is still the one the file gives
    its recipe, so `testbed run ... --out` on those results reruns nothing. A training setting added without its
    default in LATER_DEFAULTS changes every fingerprint and fails this (it did for resync_every)."""
    import json

    exp = Experiment.load(ROOT / "experiments" / f"{name}.yaml")
    rows = [json.loads(line) for line in open(ROOT / "docs" / "results" / name / "results.jsonl")]
    wrong = [r["point"] for r in rows  # a row reused from another experiment (`reuse:`) has its fingerprint there
             if r["fingerprint"] not in [exp.fingerprint(rt := None if r["runtime"] == "loopback" else r["runtime"],
                                                         r["recipe"]), *exp.reused_fingerprints(rt, r["recipe"])]]
    assert rows and not wrong, f"{len(wrong)} of {len(rows)} rows, e.g. {wrong[:3]}"


def test_unknown_recipe_in_the_grid_names_the_line(tmp_path):
    text = RECIPES.replace("recipe: [default, sanitize, protect, bf16]", "recipe: [default, sanitise]")
    path = write(tmp_path, text)
    with pytest.raises(InputError) as e:
        Experiment.load(path)
    line = text.splitlines().index("  recipe: [default, sanitise]") + 1
    assert str(e.value) == (f"{path}:{line}: grid.recipe[1]: unknown recipe 'sanitise' (the file defines: default, "
                            "sanitize, protect, bf16)")


@pytest.mark.parametrize("recipe,where", [
    ("{train: {lr: 0}}", "recipes.bad.train.lr: Input should be greater than 0"),
    ("{train: {bacth: 2}}", "recipes.bad.train.bacth: unknown key"),
    ("{train: {steps: 2}}", "recipes.bad.train.steps: unknown key"),  # set at the top, not in a recipe
    ("{link: {protect: [sign, exponant]}}", "recipes.bad.link.protect[1]"),
    ("{link: {protected_ber: 0.9}}", "recipes.bad.link.protected_ber: must lie in [0, 0.5]"),
    ("{train: {microbatches: 3}}", "recipes.bad.train: pp: microbatches: must divide batch_size 4"),
    ("{link: {protected_ber: 1e-4}}", "recipes.bad.link.protected_ber: must not exceed the grid's smallest BER"),
    ("{color: red}", "recipes.bad.color: unknown key"),
    ("{train: {wire_dtype: bf16}, link: {protect: [sign, 20]}}",
     "recipes.bad.link.protect[1]: bit 20 is not a bit of a bf16 value (0-15)"),
    ("{link: {protect: [sign], protected_fraction: 1e-3, protected_ber: 1e-9}}",
     "recipes.bad.link.protected_fraction: set protected_ber (one residual BER) or protected_fraction"),
    ("{link: {protected_fraction: 1e-3}}", "recipes.bad.link.protected_fraction: a residual on protected bits "
                                           "needs protect"),
    ("{link: {protect: [sign], protected_fraction: 2}}", "recipes.bad.link.protected_fraction: Input should be "
                                                         "less than or equal to 1"),
    ("{mode: [ddp, xp]}", "recipes.bad.mode[1]"),
    ("{topology: {ddp: nowhere.yaml}}", "recipes.bad.topology.ddp"),
])
def test_bad_recipes_name_the_field(tmp_path, recipe, where):
    text = RECIPES.replace("recipe: [default, sanitize, protect, bf16]", "recipe: [default, bad]")
    text += f"  bad: {recipe}\n"
    with pytest.raises(InputError) as e:
        Experiment.load(write(tmp_path, text))
    line = str(e.value).splitlines()[0]
    assert line.startswith(f"{tmp_path / 'exp.yaml'}:") and where in line, line
    assert line.split(":")[1] == str(text.splitlines().index(f"  bad: {recipe}") + 1)  # the recipe's line


def test_link_settings_need_scope_tensor(tmp_path):
    text = RECIPES.replace("  ber: [0, 1e-5]", "  ber: [0, 1e-5]\n  scope: [tensor, payload]")
    with pytest.raises(InputError, match=r"recipes\.protect\.link: element, protect and protected_ber need scope "
                                         r"tensor \(the grid also runs scope tensor, payload\)"):
        Experiment.load(write(tmp_path, text))


def test_tokens_per_step_gives_each_mode_its_batch(tmp_path):
    text = RECIPES.replace("  batch_size: 4\n", "  seq_len: 32\n")
    text = text.replace("steps: 4\n", "steps: 4\ntokens_per_step: 512\n")
    exp = Experiment.load(write(tmp_path, text))
    by_mode = {p.mode: p for p in exp.points() if p.recipe == "default"}
    assert exp.train_settings(by_mode["ddp"]).batch_size == 8  # 512 / (32 tokens x 2 ranks), per rank
    assert exp.train_settings(by_mode["pp"]).batch_size == 16  # 512 / 32, the global batch
    assert {exp.tokens_per_step(p) for p in exp.points()} == {512}
    plain = Experiment.load(write(tmp_path, GOOD.replace("batch_size: 4", "batch_size: 4\n  seq_len: 32"), "p.yaml"))
    assert plain.tokens_per_step(plain.points()[0]) == 4 * 32 * 2  # recorded without tokens_per_step too


@pytest.mark.parametrize("change,problem", [
    (("  batch_size: 4\n", "  seq_len: 32\n"), ("tokens_per_step: 500", "tokens_per_step: ddp: tokens_per_step 500 "
                                                "is not a multiple of seq_len x ranks = 64")),
    (("  batch_size: 4\n", "  seq_len: 32\n  microbatches: 4\n"),
     ("tokens_per_step: 64", "tokens_per_step: pp: tokens_per_step 64 gives a batch of 2 sequences, not a multiple "
                             "of 4 micro-batches")),
    (("  batch_size: 4\n", "  batch_size: 4\n"), ("tokens_per_step: 512", "train.batch_size: tokens_per_step sets "
                                                  "the batch size of every mode: set one of them, not both")),
])
def test_tokens_per_step_errors(tmp_path, change, problem):
    setting, message = problem
    text = RECIPES.replace(*change).replace("steps: 4\n", f"steps: 4\n{setting}\n")
    with pytest.raises(InputError) as e:
        Experiment.load(write(tmp_path, text))
    assert message in str(e.value), str(e.value)


@pytest.mark.parametrize("value, expected", [("1%", 0.01), ("0.5%", 0.005), ("0.02", 0.02), ("5 %", 0.05)])
def test_tolerance_is_a_fraction_or_a_percentage_and_leaves_the_fingerprint(tmp_path, value, expected):
    exp = Experiment.load(write(tmp_path, GOOD + f"tolerance: {value}\n"))
    assert exp.spec.tolerance == pytest.approx(expected)
    assert Experiment.load(write(tmp_path, GOOD, "plain.yaml")).spec.tolerance == 0.01  # the default: 1 %
    # the verdict's tolerance is not part of what trains: points stay reusable (the rows record it)
    assert exp.fingerprint() == Experiment.load(write(tmp_path, GOOD, "plain.yaml")).fingerprint()


@pytest.mark.parametrize("value, problem", [
    ("0", "must lie above 0 and below 1 (100%), got 0"),
    ("100%", "must lie above 0 and below 1 (100%), got '100%'"),
    ("150%", "must lie between 0 and 1 (0% and 100%)"),
    ("-1%", "must lie between 0 and 1 (0% and 100%)"),
    ("lots", "cannot parse 'lots': write a fraction (0.01) or a percentage ('1%')"),
    ("[1]", "expected a fraction or a percentage, got list"),
])
def test_bad_tolerance_exits_2_naming_the_line_and_field(tmp_path, value, problem):
    path = write(tmp_path, GOOD + f"tolerance: {value}\n")
    msg = refused(tmp_path, path)
    assert msg.startswith(f"{path}:{len(GOOD.splitlines()) + 1}: tolerance: "), msg
    assert problem in msg, msg


RING4 = ROOT / "topologies" / "ring4.yaml"
CHAIN4 = ROOT / "topologies" / "chain4.yaml"


def test_recipe_modes_topology_per_mode_and_protected_fraction(tmp_path):
    """A recipe may run a subset of grid.mode, take a topology per mode, and give its residual on protected bits as
    a fraction of each point's BER; each changes only that recipe's fingerprint."""
    text = RECIPES.replace("recipe: [default, sanitize, protect, bf16]",
                           "recipe: [default, r4, ddponly, protres]").replace("ber: [0, 1e-5]", "ber: [0, 1e-5, 1e-4]")
    text = text.replace("batch_size: 4", "batch_size: 4") + f"""  r4: {{topology: {{ddp: {RING4}, pp: {CHAIN4}}}}}
  ddponly: {{mode: [ddp], topology: {RING4}}}
  protres: {{link: {{protect: [sign, exponent], protected_fraction: 1e-3}}}}
"""
    exp = Experiment.load(write(tmp_path, text))
    pts = exp.points()
    assert {p.mode for p in pts if p.recipe == "ddponly"} == {"ddp"}
    assert {p.mode for p in pts if p.recipe == "r4"} == {"ddp", "pp"}
    assert exp.world_size("ddp", None, "r4") == exp.world_size("pp", None, "r4") == 4
    assert exp.topology("pp", "r4").name == "chain4" and exp.topology("ddp", "r4").name == "ring4"
    assert exp.topology("pp", "default").name == "pair"
    res = {p.ber: exp.link_settings(p)["protected_ber"] for p in pts if p.recipe == "protres" and p.mode == "ddp"}
    assert res == {0.0: 0.0, 1e-5: pytest.approx(1e-8), 1e-4: pytest.approx(1e-7)}
    fps = {r: exp.fingerprint(None, r) for r in ("default", "r4", "ddponly", "protres")}
    assert len(set(fps.values())) == 4
    # the portable copy keeps the per-mode topologies, as absolute paths
    copy = write(tmp_path, exp.portable_copy(), "copy.yaml")
    again = Experiment.load(copy)
    assert {r: again.fingerprint(None, r) for r in fps} == fps


def test_reuse_counts_another_experiments_rows_of_the_same_recipe(tmp_path):
    """`reuse: [other]`: a recipe with the same name and settings as in experiment `other` accepts that
    experiment's rows (their fingerprint is the recipe's under that name); a changed recipe does not."""
    from testbed.experiments.runner import ResultsStore, open_run

    first = Experiment.load(write(tmp_path, RECIPES, "first.yaml"))
    second_text = RECIPES.replace("name: check", "name: second\nreuse: [check]").replace(
        "sanitize_threshold: 100.0", "sanitize_threshold: 10.0")
    second = Experiment.load(write(tmp_path, second_text, "second.yaml"))
    assert second.fingerprint(None, "protect") != first.fingerprint(None, "protect")  # the name is in the hash
    assert second.reused_fingerprints(None, "protect") == [first.fingerprint(None, "protect")]
    assert second.reused_fingerprints(None, "sanitize") != [first.fingerprint(None, "sanitize")]  # changed
    out = tmp_path / "out"
    out.mkdir()
    rows = [{"point": p.id, "recipe": p.recipe, "fingerprint": first.fingerprint(None, p.recipe), "status": "ok"}
            for p in first.points()]
    (out / "results.jsonl").write_text("".join(__import__("json").dumps(r) + "\n" for r in rows))
    _, _, fps, store, points = open_run(second, out, None)
    try:
        done = {p.recipe for p in points if store.done(p, fps[p.recipe])}
        assert done == {"default", "protect", "bf16"}  # sanitize changed: its points run again
    finally:
        store.close()
    # the changed recipe's rows are another fingerprint's: moved aside, as any stale row is
    aside = [__import__("json").loads(line) for f in out.glob("results-*.jsonl") for line in open(f)]
    assert sorted(r["recipe"] for r in aside) == ["sanitize"] * 4
    assert len(ResultsStore(out, set(fps.values()), {first.fingerprint(None, "protect"): fps["protect"]}).rows) == 4


def test_a_resumed_warm_run_carries_on_with_the_group_it_stopped_in(tmp_path):
    """Warm order (runner.warm_order): a group's points together, groups in the order of their first point that is
    not a clean run. The grid lists every mode's clean runs first, so ordering groups by their first point to run
    started PP's group (its clean seeds missing) when a run stopped in the middle of DDP's BER points."""
    from testbed.experiments.runner import warm_order

    exp = Experiment.load(write(tmp_path, GOOD.replace("mode: [ddp]", "mode: [ddp, pp]").replace(
        "ber: [0, 1e-5]", "ber: [0, 1e-5, 1e-4]\n  seed: [1, 2]").replace("topologies:\n  ddp: ",
        f"topologies:\n  pp: {PAIR}\n  ddp: ")))
    points = exp.points()
    clean = [p for p in points if p.baseline == p]
    assert points[:len(clean)] == clean and {p.mode for p in clean} == {"ddp", "pp"}  # what made it matter
    done = {p.id for p in clean if p.mode == "ddp"} | {"ddp-ber1e-5-tensor-fix-s1"}
    order = warm_order(exp, [p for p in points if p.id not in done])
    assert [p.id for p in order] == [
        "ddp-ber1e-5-tensor-fix-s2", "ddp-ber1e-4-tensor-fix-s1", "ddp-ber1e-4-tensor-fix-s2",
        "pp-ber0-tensor-fix-s1", "pp-ber0-tensor-fix-s2", "pp-ber1e-5-tensor-fix-s1", "pp-ber1e-5-tensor-fix-s2",
        "pp-ber1e-4-tensor-fix-s1", "pp-ber1e-4-tensor-fix-s2"], [p.id for p in order]
    # a fresh run: each group's clean runs before its points, DDP's group first as in the grid
    fresh = [p.id for p in warm_order(exp, points)]
    assert fresh[:2] == ["ddp-ber0-tensor-fix-s1", "ddp-ber0-tensor-fix-s2"]
    assert fresh.index("pp-ber0-tensor-fix-s1") == 6


def test_rerun_check_names_the_fields_a_clean_run_trained_again_did_not_reproduce():
    """A clean run whose run directory is gone trains again (runner.points_to_run); the runner compares it with
    its row: bit for bit, or which fields differ and on which CPU and torch each ran."""
    from testbed.experiments.runner import REPRODUCED_FIELDS, rerun_check

    row = {"status": "ok", "final_eval_loss": 5.943, "loss_curve": [[1, 10.9], [2, 10.1]], "wall_time_s": 900.0,
           "machine": {"cpu": "AMD EPYC", "vector": "avx512f", "torch": "2.13.0+cpu"}}
    again = {**row, "wall_time_s": 1001.5, "finished_at": "later"}  # timing is not what a run computes
    assert rerun_check(row, again).startswith("the same run bit for bit")
    other = {**again, "final_eval_loss": 5.9430001, "machine": {"cpu": "Intel Xeon", "vector": "avx512f",
                                                                "torch": "2.13.0+cpu"}}
    text = rerun_check(row, other)
    assert text.startswith("NOT the same") and "final_eval_loss" in text and "loss_curve" not in text
    assert "AMD EPYC" in text and "Intel Xeon" in text
    assert "final_eval_loss" in REPRODUCED_FIELDS and "wall_time_s" not in REPRODUCED_FIELDS
