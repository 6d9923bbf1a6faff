"""The size ladder (issue 22): the preset table, grid `ber_at_lambda`, recipe model/steps/baseline, controls,
and the report's size-ladder section on synthetic rows. Pure: no root, no namespaces (the perturbation test that
trains over a topology is in tests/test_recipes.py)."""

from __future__ import annotations

import json
import math

import pytest

from conftest import ROOT
from testbed.analysis import scaling, theory
from testbed.experiments.spec import Experiment, format_ber
from testbed.topology.yamlfile import InputError
from testbed.train.model import PRESET_PARAMS, PRESETS, build_model, count_params

PAIR = ROOT / "topologies" / "pair.yaml"

LADDER = f"""name: ladder
model: tiny
steps: 10
tokens_per_step: 512
topologies: {{ddp: {PAIR}, pp: {PAIR}}}
recipes:
  tiny: {{model: tiny}}
  tiny-sanitize: {{model: tiny, train: {{guard: sanitize}}}}
  tiny-lsb: {{model: tiny, baseline: tiny, train: {{perturb: lsb}}}}
  small: {{model: small, steps: 7}}
grid:
  recipe: [tiny, tiny-sanitize, tiny-lsb, small]
  mode: [ddp, pp]
  ber: [0]
  ber_at_lambda: [0.1, 1, 3]
  seed: [1, 2]
train: {{seq_len: 64}}
"""


def write(tmp_path, text: str):
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    return path


def problems(tmp_path, text: str) -> str:
    with pytest.raises(InputError) as e:
        Experiment.load(write(tmp_path, text))
    return str(e.value)


def test_presets_span_the_ladder_with_the_stated_counts():
    for name in PRESETS:
        p = PRESETS[name]
        assert theory.param_count(name) == PRESET_PARAMS[name] == theory.gpt2_param_count(
            p.n_layer, p.n_embd, p.n_positions, p.vocab_size)
    assert PRESETS["mini"][:3] == (6, 6, 384) and 10e6 <= PRESET_PARAMS["mini"] <= 15e6
    assert PRESET_PARAMS["gpt2-124m"] / PRESET_PARAMS["tiny"] >= 500
    assert count_params(build_model("mini", 0)) == PRESET_PARAMS["mini"] == 13_891_584


def test_ber_at_lambda_expands_per_recipe_and_mode(tmp_path):
    exp = Experiment.load(write(tmp_path, LADDER))
    pts = exp.points()
    lam_pts = [p for p in pts if p.lam is not None]
    # tiny, tiny-sanitize and small at 3 lambdas x 2 modes x 2 seeds; the control only at BER 0
    assert len(lam_pts) == 3 * 3 * 2 * 2
    assert all(p.ber == 0 for p in pts if p.recipe == "tiny-lsb")
    for p in lam_pts:
        cfg = exp.train_settings(p)
        shape = ({"n_params": cfg.model} if p.mode == "ddp" else
                 {"batch_size": cfg.batch_size, "seq_len": 64, "width": PRESETS[cfg.model].n_embd})
        lam = p.ber * theory.lambda_per_ber(p.mode, 2, **shape)
        assert lam == pytest.approx(p.lam, rel=5e-3)  # BER to 3 significant digits
    # DDP: lambda = 2 (N-1) n b exactly for fp32 gradients
    tiny_ddp = next(p for p in lam_pts if p.recipe == "tiny" and p.mode == "ddp" and p.lam == 1)
    assert tiny_ddp.ber == float(f"{1 / (2 * theory.param_count('tiny')):.3g}")
    # the three recipes of a size share BERs; sizes differ; the recipe's model and steps reach the settings
    assert {p.ber for p in lam_pts if p.recipe == "tiny"} == {p.ber for p in lam_pts if p.recipe == "tiny-sanitize"}
    small = next(p for p in lam_pts if p.recipe == "small")
    assert exp.train_settings(small).model == "small" and exp.train_settings(small).steps == 7
    assert exp.fingerprint(recipe="small") != exp.fingerprint(recipe="tiny")
    # a control is compared with its baseline recipe's clean run of the same seed
    ctl = next(p for p in pts if p.recipe == "tiny-lsb" and p.mode == "ddp" and p.seed == 1)
    assert ctl.baseline.id == "ddp-ber0-tensor-fix-tiny-s1" and ctl.baseline in pts
    assert pts.index(ctl.baseline) < pts.index(ctl)
    assert exp.train_settings(ctl).perturb == "lsb"


@pytest.mark.parametrize("value, expect", [
    ("[0]", "grid.ber_at_lambda[0]: Input should be greater than 0"),
    ("[1, -2]", "grid.ber_at_lambda[1]: Input should be greater than 0"),
    ("[.inf]", "grid.ber_at_lambda[0]: Input should be a finite number"),
    ("[abc]", "grid.ber_at_lambda[0]: Input should be a valid number"),
    ("[]", "grid.ber_at_lambda: List should have at least 1 item"),
    ("[1e9]", "grid.ber_at_lambda[0]: recipe tiny, ddp: lambda 1e+09 needs BER"),
])
def test_bad_ber_at_lambda_names_the_field(tmp_path, value, expect):
    msg = problems(tmp_path, LADDER.replace("ber_at_lambda: [0.1, 1, 3]", f"ber_at_lambda: {value}"))
    assert expect in msg, msg
    assert ":16: " in msg or ":15: " in msg  # the line of the grid field


def test_ber_at_lambda_without_catastrophic_values_is_refused(tmp_path):
    text = LADDER.replace("  small: {model: small, steps: 7}", "  small: {model: small, train: {wire_dtype: fp16}}")
    msg = problems(tmp_path, text.replace("mode: [ddp, pp]", "mode: [ddp]"))
    assert "grid.ber_at_lambda[0]: recipe small, ddp: no single flip of a fp16 value" in msg, msg


@pytest.mark.parametrize("recipe, expect", [
    ("{model: tiny, train: {perturb: order}}", "recipes.ctl.baseline: a control (train: perturb) must name"),
    ("{model: tiny, baseline: nope, train: {perturb: order}}", "recipes.ctl.baseline: must name another recipe"),
    ("{model: tiny, baseline: ctl, train: {perturb: order}}", "recipes.ctl.baseline: must name another recipe"),
    ("{model: tiny, baseline: tiny, train: {guard: sanitize}}",
     "recipes.ctl.baseline: a recipe shares another's clean runs only when it differs from it in link: alone "
     "(here also guard)"),
    ("{model: small, baseline: tiny, link: {protect: [sign]}}", "(here also model)"),
    ("{model: tiny, baseline: tiny-lsb, train: {perturb: order}}", "tiny-lsb is a control itself"),
    ("{model: huge}", "recipes.ctl.model: Input should be"),
    ("{model: tiny, train: {perturb: flip}}", "recipes.ctl.train.perturb: Input should be"),
])
def test_bad_control_recipes_are_refused(tmp_path, recipe, expect):
    text = LADDER.replace("  small: {model: small, steps: 7}", f"  small: {{model: small}}\n  ctl: {recipe}")
    text = text.replace("recipe: [tiny, tiny-sanitize, tiny-lsb, small]", "recipe: [tiny, tiny-lsb, small, ctl]")
    assert expect in problems(tmp_path, text)


def test_a_file_wide_perturbation_is_refused(tmp_path):
    text = LADDER.replace("train: {seq_len: 64}", "train: {seq_len: 64, perturb: order}")
    assert "train.perturb: a perturbation is a control: set it in a recipe" in problems(tmp_path, text)


def test_a_recipe_model_checks_its_own_context(tmp_path):
    text = LADDER.replace("train: {seq_len: 64}", "train: {seq_len: 128}")
    assert "seq_len: must be <= 64 (the context of tiny)" in problems(tmp_path, text)


def test_scaling_yaml_loads_with_every_size():
    exp = Experiment.load(ROOT / "experiments" / "scaling.yaml")
    pts = exp.points()
    models = {exp.model_of(p.recipe) for p in pts}
    assert models == set(PRESETS)
    assert min(exp.steps_of(p.recipe) for p in pts if exp.model_of(p.recipe) == "gpt2-124m") >= 20
    lams = {p.lam for p in pts if p.lam is not None}
    assert lams == {0.1, 0.3, 1.0, 3.0}
    # equal tokens per step in both modes, every size
    assert {exp.tokens_per_step(p) for p in pts} == {512}


# ---- the analysis on synthetic rows ----------------------------------------------------------------------------

def row(model="tiny", mode="ddp", recipe="tiny", ber=0.0, lam=None, skipped=0, steps=100, guard="skip",
        protect=None, sanitized=None, perturb="none", deviation=None, seed=1, status="ok", injector="wire"):
    return {"point": f"{mode}-{ber}-{recipe}-s{seed}", "recipe": recipe, "mode": mode, "ber": ber,
            "ber_at_lambda": lam, "scope": "tensor", "checksum": "fix", "seed": seed, "model": model,
            "n_params": theory.param_count(model), "world_size": 2, "batch_size": 4 if mode == "ddp" else 8,
            "seq_len": 64, "steps": steps, "steps_completed": steps, "skipped_steps": skipped, "status": status,
            "guard": guard, "protect": protect, "sanitized_values": sanitized, "perturb": perturb,
            "final_deviation": deviation, "lr": 1e-3, "injector": injector, "median_step_time_s": 0.05,
            "wall_time_s": 6.0}


def test_lambda_cell_verdicts_follow_the_binomial_interval():
    ber = float(f"{1 / (2 * theory.param_count('tiny')):.3g}")  # lambda 1: P(lost) = 0.632
    p = -math.expm1(-ber * 2 * theory.param_count("tiny"))
    lo, hi = scaling.binomial_interval(200, p)
    assert lo < 200 * p < hi
    # the process injector: each seed its own flips, so the two runs' steps pool into 200 trials
    rows = [row(ber=ber, lam=1.0, skipped=k, seed=s, injector="process") for s, k in ((1, lo // 2), (2, lo - lo // 2))]
    (cell,) = scaling.lambda_cells(rows)
    assert not cell["shared_flips"]
    assert cell["lost"] == lo and cell["steps"] == 200 and cell["lost_verdict"] == "agrees"
    assert cell["wire_lambda"] == pytest.approx(1.0, rel=5e-3)
    rows[0]["skipped_steps"] -= 1
    assert scaling.lambda_cells(rows)[0]["lost_verdict"] == "below"
    rows[0]["skipped_steps"] += 1 + (hi - lo) + 1
    assert scaling.lambda_cells(rows)[0]["lost_verdict"] == "above"
    # sanitize predicts no lost step: one lost step is above; its sanitized count is judged against Poisson
    san = [row(recipe="tiny-sanitize", ber=ber, lam=1.0, guard="sanitize", skipped=0, sanitized=150)]
    (cell,) = scaling.lambda_cells(san)
    assert cell["kind"] == "sanitize" and cell["predicted_lost"] == 0 and cell["lost_verdict"] == "agrees"
    assert cell["sanitized_verdict"] is not None
    san[0]["skipped_steps"] = 1
    assert scaling.lambda_cells(san)[0]["lost_verdict"] == "above"


def test_wire_seeds_that_share_their_flips_count_as_one_run():
    """On the wire every seed of a cell gets the same flips (the engines are seeded by the topology's link seeds):
    the cell counts one run's trials, the mean of the seeds' counts, and its interval is that of one run's steps;
    two process-injector seeds are independent and pool."""
    ber = float(f"{1 / (2 * theory.param_count('tiny')):.3g}")
    wire = [row(ber=ber, lam=1.0, skipped=k, seed=s, sanitized=n, guard="sanitize", recipe="tiny-sanitize")
            for s, k, n in ((1, 0, 150), (2, 0, 152))]
    wire += [row(ber=ber, lam=1.0, skipped=k, seed=s) for s, k in ((1, 63), (2, 64))]
    cells = {c["recipe"]: c for c in scaling.lambda_cells(wire)}
    c = cells["tiny"]
    assert c["shared_flips"] and (c["lost"], c["steps"]) == (64, 100)  # round(63.5) (to even), one run's steps
    p = -math.expm1(-1.0)
    assert c["lost_interval"] == scaling.binomial_interval(100, p)
    s = cells["tiny-sanitize"]
    assert (s["sanitized"], s["sanitized_steps"]) == (151, 100)
    process = [dict(r, injector="process") for r in wire]
    c = {c["recipe"]: c for c in scaling.lambda_cells(process)}["tiny"]
    assert not c["shared_flips"] and (c["lost"], c["steps"]) == (127, 200)
    # the wire with link_seed run: each seed its own draw of the link, pooled as the process injector's are
    drawn = [dict(r, link_seed="run") for r in wire]
    c = {c["recipe"]: c for c in scaling.lambda_cells(drawn)}["tiny"]
    assert not c["shared_flips"] and (c["lost"], c["steps"]) == (127, 200)
    # one wire run alone is its own count
    (one,) = scaling.lambda_cells(wire[2:3])
    assert not one["shared_flips"] and (one["lost"], one["steps"]) == (63, 100)


def test_the_ladder_section_explains_the_shared_flips_mark_only_where_a_cell_has_it(tmp_path):
    from testbed.report.scaling import scaling_section

    ber = float(f"{1 / (2 * theory.param_count('tiny')):.3g}")
    wire = [row(ber=ber, lam=1.0, skipped=k, seed=s) for s, k in ((1, 63), (2, 64))]
    shared = "\n".join(scaling_section(wire, tmp_path))
    assert "64/100 ‡" in shared and "‡: wire points at `link_seed: topology`" in shared
    drawn = "\n".join(scaling_section([dict(r, link_seed="run") for r in wire], tmp_path))
    assert "127/200" in drawn and "‡" not in drawn and "each seed drew its own flips" in drawn


def test_report_section_on_synthetic_rows(tmp_path):
    from testbed.report.report import write_report

    ber = float(f"{1 / (2 * theory.param_count('tiny')):.3g}")
    rows = [row(seed=1, deviation=0.0), row(ber=ber, lam=1.0, skipped=60, deviation=0.5),
            row(recipe="tiny-lsb", perturb="lsb", deviation=0.0), row(recipe="tiny-order", perturb="order",
                                                                     deviation=0.01)]
    for r in rows:  # the fields the rest of the report reads, as a real row has them
        r.setdefault("final_eval_loss", 5.0)
    md = write_report(tmp_path, rows=rows, latency={}, experiment={"name": "ladder"}).read_text()
    assert "## Size ladder: lost steps against λ for every model size" in md
    assert "![Lost-step fraction vs λ, every model size](lambda_collapse.png)" in md
    assert (tmp_path / "lambda_collapse.png").stat().st_size > 0
    assert "### The chaos floor" in md and "lsb 0" in md and "order 0.01" in md
    assert "bit-identical to the clean run" in md
    # an experiment without lambda points or controls has no such section
    plain = write_report(tmp_path / "plain", rows=[row(recipe="default")], latency={}, experiment={}).read_text()
    assert "Size ladder" not in plain


def test_run_in_parts_refuses_a_pattern_that_matches_no_recipe(tmp_path):
    from conftest import tb_cli

    out = tmp_path / "out"
    r = tb_cli("run", str(ROOT / "experiments" / "scaling.yaml"), "--out", str(out), "--recipes", "huge*,x")
    assert r.returncode == 2, (r.stdout, r.stderr[-2000:])
    assert "--recipes huge*,x: no recipe of the grid matches (tiny, tiny-protect" in r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


def test_a_ladder_with_controls_runs_end_to_end_with_the_process_injector(tmp_path):
    """`testbed run` on a small ladder (real gloo on loopback, the process injector): a lambda point and two
    controls per recipe model; rows carry the recipe's model, steps, the lambda and the perturbation; a control's
    deviation is measured against its baseline recipe's clean run; the report has the size-ladder section."""
    from conftest import tb_cli

    f = tmp_path / "ladder.yaml"
    f.write_text(f"""name: ladder
model: tiny
steps: 6
tokens_per_step: 256
topologies: {{ddp: {PAIR}}}
recipes:
  t: {{model: tiny, train: {{injector: process}}}}
  t-lsb: {{model: tiny, baseline: t, train: {{injector: process, perturb: lsb}}}}
  t-wlsb: {{model: tiny, baseline: t, train: {{injector: process, perturb: weight-lsb}}}}
  s: {{model: small, steps: 4, train: {{injector: process}}}}
grid: {{recipe: [t, t-lsb, t-wlsb, s], mode: [ddp], ber: [0], ber_at_lambda: [1], seed: [1]}}
train: {{seq_len: 32, eval_every: 3, timeout: 30}}
""")
    out = tmp_path / "out"
    r = tb_cli("run", str(f), "--out", str(out), "--recipes", "t*")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["point"]: row for row in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    ber = float(f"{1 / (2 * theory.param_count('tiny')):.3g}")  # lambda 1 on 2 ranks
    assert set(rows) == {"ddp-ber0-tensor-fix-t-s1", "ddp-ber0-tensor-fix-t-lsb-s1", "ddp-ber0-tensor-fix-t-wlsb-s1",
                         f"ddp-ber{format_ber(ber)}-tensor-fix-t-s1"}, sorted(rows)
    assert all(x["status"] == "ok" and x["injector"] == "process" and x["model"] == "tiny" for x in rows.values())
    lam = next(x for x in rows.values() if x["ber"] > 0)
    assert lam["ber_at_lambda"] == 1.0 and lam["perturb"] == "none" and lam["steps"] == 6
    lsb, wlsb = rows["ddp-ber0-tensor-fix-t-lsb-s1"], rows["ddp-ber0-tensor-fix-t-wlsb-s1"]
    assert lsb["baseline"] == wlsb["baseline"] == "ddp-ber0-tensor-fix-t-s1"
    assert lsb["perturb"] == "lsb" and lsb["final_deviation"] == 0.0 and lsb["final_deviation_exact"]
    assert wlsb["perturb"] == "weight-lsb" and wlsb["final_deviation"] > 0 and wlsb["final_deviation_exact"]
    md = (out / "report.md").read_text()
    assert "## Size ladder" in md and "### The chaos floor" in md and (out / "lambda_collapse.png").exists()
    # the second part: the small recipe, resuming the first part's rows
    r = tb_cli("run", str(f), "--out", str(out), "--recipes", "s")
    assert r.returncode == 0, r.stderr[-3000:]
    rows2 = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows2) == 6 and {x["model"] for x in rows2} == {"tiny", "small"}
    small = [x for x in rows2 if x["model"] == "small"]
    assert all(x["steps"] == 4 and x["n_params"] == PRESET_PARAMS["small"] for x in small)
    assert {x["point"]: x["finished_at"] for x in rows2 if x["model"] == "tiny"} == {
        p: x["finished_at"] for p, x in rows.items()}  # the first part's rows were kept, not re-run


def test_pp_cells_below_the_prediction_are_read_against_the_backward_only_bound():
    """A PP cell that loses about as many steps as its backward catastrophic values alone predict lies inside the
    bracket [backward-only, full prediction], and the share of forward values contained reads near 1."""
    from testbed.report.scaling import _disagreement_lines

    rows = [row(mode="pp", ber=1.0, lam=1.0, seed=seed, injector="process", steps=100) for seed in (1, 2)]
    (probe,) = scaling.lambda_cells(rows[:1])
    for r in rows:  # lambda is linear in the BER: the BER of lambda 1 for this row's shape
        r["ber"] = 1.0 / probe["prediction"].lost
    (cell,) = scaling.lambda_cells(rows)
    pred = cell["prediction"]
    back = pred.lost - pred.lost_forward
    for r in rows:
        r["skipped_steps"] = round(100 * -math.expm1(-back))
    (cell,) = scaling.lambda_cells(rows)
    assert cell["lost_verdict"] == "below"
    text = " ".join(_disagreement_lines(scaling.lambda_summary([cell])))
    assert "1 of these 1 cells lie between the backward-only prediction" in text
    share = float(text.split("less the backward part): ")[1].split(" to ")[0])
    assert share > 0.8
