"""The paper-regime table's statistics (testbed/analysis/regime.py) on hand-made rows: pure logic, no root. The
rows it reads come from real runs of experiments/paper-regime.yaml (docs/results/paper-regime)."""

from __future__ import annotations

import math

import pytest

from testbed.analysis import regime, scaling
from testbed.analysis.analysis import aggregate, thresholds
from testbed.report.paperregime import paper_regime_section


def row(recipe, mode, ber, seed, eval_loss, *, model="tiny", steps=300, world=2, dev=None, perturb="none",
        guard="skip", wire="fp32", protect=None, protected_ber=0.0, curve=None):
    return {"point": f"{mode}-{ber}-{recipe}-{seed}", "recipe": recipe, "mode": mode, "scope": "tensor",
            "checksum": "fix", "ber": ber, "seed": seed, "status": "ok", "model": model, "steps": steps,
            "steps_completed": steps, "world_size": world, "initial_eval_loss": 6.0, "final_eval_loss": eval_loss,
            "final_deviation": dev, "perturb": perturb, "guard": guard, "wire_dtype": wire, "protect": protect,
            "protected_ber": protected_ber, "tokens_per_step": 512, "batch_size": 4, "seq_len": 64,
            "eval_curve": curve or [[steps, eval_loss]], "made_progress": True}


def ladder(recipe, bers_ok, bers_fail, *, dev_at_ok=1.0, **kw):
    rows = [row(recipe, "ddp", 0.0, s, 4.0 + 0.001 * s, dev=0.0, **kw) for s in (1, 2, 3)]
    rows += [row(recipe, "ddp", b, s, 4.0 + 0.001 * s, dev=dev_at_ok, **kw) for b in bers_ok for s in (1, 2, 3)]
    rows += [row(recipe, "ddp", b, s, 4.5 + 0.01 * s, dev=10.0, **kw) for b in bers_fail for s in (1, 2, 3)]
    return rows


def controls(value, **kw):
    return [row("c", "ddp", 0.0, s, 4.0, dev=value, perturb="weight-lsb", **kw) for s in (1, 2, 3)]


def table_of(rows):
    th = thresholds(aggregate(rows), 0.01)
    return th, regime.regime_table(rows, th)


@pytest.mark.parametrize("settings,residual,label", [
    ({}, 0, "default"), ({"guard": "sanitize"}, 0, "sanitize"), ({"wire_dtype": "bf16"}, 0, "bf16"),
    ({"protect": "sign,exponent"}, 0, "protect"), ({"protect": "sign,exponent"}, 1e-3, "protect + residual"),
    ({"guard": "sanitize", "protect": "sign"}, 0, "sanitize + protect"), ({"clip": "none"}, 0, "clip none"),
])
def test_recipe_label_is_read_from_settings(settings, residual, label):
    assert regime.recipe_label({"settings": settings, "residual": residual}) == label


def test_floor_ratio_decides_tolerated_or_indistinguishable():
    rows = ladder("a", [1e-6], [1e-5], dev_at_ok=5.0) + controls(0.5)
    _, table = table_of(rows)
    (e,) = table
    assert (e["max_ok"], e["min_fail"], e["floor"]) == (1e-6, 1e-5, 0.5)
    assert e["floor_ratio"] == pytest.approx(10.0) and e["verdict"] == "tolerated"
    rows = ladder("a", [1e-6], [1e-5], dev_at_ok=0.4) + controls(0.5)
    assert table_of(rows)[1][0]["verdict"] == "indistinguishable"
    # no controls of the same size and steps: no floor, said so
    rows = ladder("a", [1e-6], [1e-5]) + controls(0.5, steps=3000)
    assert table_of(rows)[1][0]["verdict"] == "tolerated (no floor measured)"
    rows = ladder("a", [], [1e-6]) + controls(0.5)
    assert table_of(rows)[1][0]["verdict"] == "fails at every tested BER"


def test_cheapest_recipe_is_the_first_in_cost_order_that_reaches_the_paper():
    rows = (ladder("def", [], [1e-6]) + ladder("prot", [1e-5, 1e-4], [1e-3], protect="sign,exponent")
            + ladder("sp", [1e-5, 1e-4, 1e-3], [], guard="sanitize", protect="sign,exponent")
            + ladder("res", [1e-5], [1e-4], protect="sign,exponent", protected_ber=1e-3) + controls(0.5))
    for r in rows:  # protres: the residual is 1e-3 x each point's BER
        if r["recipe"] == "res":
            r["protected_ber"] = 1e-3 * r["ber"]
    _, table = table_of(rows)
    (c,) = regime.cheapest(table)
    assert c["cheapest"]["label"] == "protect"  # sanitize + protect also reaches 1e-4, but costs more
    assert c["tried"] == ["default", "protect + residual", "protect", "sanitize + protect"]
    md = "\n".join(paper_regime_section(rows, thresholds(aggregate(rows), 0.01)))
    assert "the cheapest recipe that reaches the paper's 1e-04 is **protect**" in md


def test_a_recipe_whose_clean_runs_fail_against_the_default_is_flagged_and_never_named_cheapest():
    """124M PP sanitize: its clean seed 1 zeroed 40,456 real activations (> sanitize_threshold) and ended +0.066
    over the default's clean run of the same seed. Its threshold is against its own clean runs, so it could pass
    the paper's BER while training worse than no recipe at all."""
    worse = [dict(r, final_eval_loss=r["final_eval_loss"] + 0.1)
             for r in ladder("san", [1e-5, 1e-4], [], guard="sanitize")]
    rows = ladder("def", [], [1e-6]) + worse + controls(0.5)
    _, table = table_of(rows)
    san = next(e for e in table if e["label"] == "sanitize")
    c = san["clean_cost"]
    assert c["verdict"] == "fails" and c["mean"] == pytest.approx(0.1) and set(c["gaps"]) == {1, 2, 3}
    assert next(e for e in table if e["label"] == "default")["clean_cost"] is None  # nothing to compare with
    assert san["reaches_paper"]
    (ch,) = regime.cheapest(table)
    assert ch["cheapest"] is None and ch["costly"] == ["sanitize"]
    md = "\n".join(paper_regime_section(rows, thresholds(aggregate(rows), 0.01)))
    assert "sanitize (clean runs fail against the default's)" in md and "never named cheapest" in md
    # the same recipe with clean runs as good as the default's is named
    rows = ladder("def", [], [1e-6]) + ladder("san", [1e-5, 1e-4], [], guard="sanitize") + controls(0.5)
    _, table = table_of(rows)
    assert next(e for e in table if e["label"] == "sanitize")["clean_cost"]["verdict"] == "within tolerance"
    assert regime.cheapest(table)[0]["cheapest"]["label"] == "sanitize"
    # one paired seed: shown, not judged
    one = [r for r in worse if r["seed"] == 1 or r["ber"] > 0]
    rows = ladder("def", [], [1e-6]) + one + controls(0.5)
    _, table = table_of(rows)
    c = next(e for e in table if e["label"] == "sanitize")["clean_cost"]
    assert c["verdict"] == "undecided" and list(c["gaps"]) == [1]
    assert "one paired seed has no bound" in "\n".join(paper_regime_section(rows, thresholds(aggregate(rows), 0.01)))


def test_a_one_seed_cross_check_is_no_threshold_row_and_not_the_default_to_compare_with():
    """paper-regime's 124m-wire (DDP seed 1 on the wire, recipe settings the default's): it was a row "fails at every
    tested BER" (one seed cannot pass) and, as the last default config, the clean runs every other recipe was set
    against (one seed)."""
    rows = ladder("def", [1e-6], [1e-5]) + ladder("san", [1e-6], [1e-5], guard="sanitize") + controls(0.5)
    rows += [r for r in ladder("wire", [1e-6], [1e-5]) if r["seed"] == 1]
    th, table = table_of(rows)
    assert [e["recipe"] for e in table] == ["def", "san"]
    assert len(next(e for e in table if e["recipe"] == "san")["clean_cost"]["gaps"]) == 3
    assert regime.one_seed(th) == [{"model": "tiny", "mode": "ddp", "recipe": "wire"}]
    assert "Not in the table, one seed" in "\n".join(paper_regime_section(rows, th))


def test_rank_fit_measures_the_slope_against_ranks():
    rows = []
    for world, (ok, fail) in {2: (1e-7, 3e-7), 4: (3e-8, 1e-7), 8: (1e-8, 3e-8)}.items():
        rows += [{**r, "recipe": f"r{world}", "point": r["point"] + f"w{world}"}
                 for r in ladder("x", [ok], [fail], world=world)]
    (f,) = regime.rank_fits(thresholds(aggregate(rows), 0.01))
    assert [p["ranks"] for p in f["points"]] == [2, 4, 8]
    assert f["fit"]["slope"] == pytest.approx(-1 / math.log10(4), abs=0.01)  # midpoints a half-decade apart
    assert f["theory_slope"] == pytest.approx(-1.4, abs=0.1)  # lambda per BER grows as 2 (N - 1)


def test_long_run_gap_change_and_verdict():
    steps = list(range(99, 3000, 100))  # eval_curve counts from step 0: 99 is the end of the 100th
    rows = []
    for s in (1, 2, 3):
        clean = [[st, 4.0 - st / 10000] for st in steps]
        rows.append(row("long", "ddp", 0.0, s, clean[-1][1], steps=3000, curve=clean, dev=0.0))
        grow = [[st, 4.0 - st / 10000 + 0.01 + (st + 1) / 100000 + 0.001 * s] for st in steps]
        rows.append(row("long", "ddp", 1e-7, s, grow[-1][1], steps=3000, curve=grow, dev=2.0))
    rows += controls(0.5, steps=3000)
    (e,) = regime.long_runs(rows)
    assert e["change"]["from"] == 300 and e["change"]["to"] == 3000
    assert e["change"]["mean"] == pytest.approx(0.027) and e["change"]["verdict"] == "grows"
    assert e["floor_ratio"] == pytest.approx(4.0)
    for r in rows:  # the same gap throughout (seed-dependent offsets only): "stays"
        if r["ber"] > 0:
            r["eval_curve"] = [[st, 4.0 - st / 10000 + 0.01 + 0.001 * r["seed"] * ((st + 1) % 200 == 0)] for st in steps]
    assert regime.long_runs(rows)[0]["change"]["verdict"] == "stays"


def test_wall_times_sum_and_median_per_size_mode_steps_and_ranks():
    rows = ladder("a", [1e-6], [1e-5]) + ladder("b", [1e-6], [], world=4) + controls(0.5, model="small")
    for i, r in enumerate(rows):
        r["wall_time_s"] = 10.0 * (i + 1)
    rows[0]["wall_time_s"] = None  # a row without a wall time is not counted
    times = scaling.time_per_size(rows, by=("model", "mode", "steps", "world_size"))
    assert [(e["model"], e["world_size"], e["timed"]) for e in times] == [("tiny", 2, 8), ("tiny", 4, 6),
                                                                         ("small", 2, 3)]
    assert times[0]["wall_time_s"] == pytest.approx(sum(10.0 * i for i in range(2, 10)))
    assert times[0]["median_wall_time_s"] == pytest.approx(55.0)
    assert times[1]["median_wall_time_s"] == pytest.approx(125.0)
    md = "\n".join(paper_regime_section(rows, thresholds(aggregate(rows), 0.01)))
    assert "### Wall time of the runs" in md and "| tiny | DDP | 300 | 4 | 6 | 12.5 min | 2.1 min |" in md


def test_ranks_modes_and_a_residual_run_end_to_end_with_the_process_injector(tmp_path):
    """`testbed run` on a small paper-regime file (real gloo on loopback, the process injector): a recipe with a
    topology per mode trains DDP on 4 ranks (ring4) and PP on 4 stages (chain4); a DDP-only recipe runs no PP
    point; protected_fraction gives each point its residual; the report leads with the paper-regime table."""
    import json

    from conftest import ROOT, tb_cli

    topo = ROOT / "topologies"
    f = tmp_path / "regime.yaml"
    f.write_text(f"""name: regime
model: tiny
steps: 4
tokens_per_step: 256
topologies: {{ddp: {topo / 'pair.yaml'}, pp: {topo / 'pair.yaml'}}}
recipes:
  r4: {{topology: {{ddp: {topo / 'ring4.yaml'}, pp: {topo / 'chain4.yaml'}}}, ber: [1e-4]}}
  plain: {{mode: [ddp], ber: [1e-3]}}
  res: {{mode: [ddp], baseline: plain, link: {{protect: [sign, exponent], protected_fraction: 1e-3}}, ber: [1e-3]}}
  res-wlsb: {{mode: [ddp], baseline: plain, train: {{perturb: weight-lsb}}}}
grid: {{recipe: [r4, plain, res, res-wlsb], mode: [ddp, pp], ber: [0], seed: [1, 2]}}
train: {{injector: process, seq_len: 32, eval_every: 2, eval_batches: 1, timeout: 60}}
""")
    out = tmp_path / "out"
    r = tb_cli("run", str(f), "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert all(x["status"] == "ok" and x["injector"] == "process" for x in rows), [x["status"] for x in rows]
    r4 = [x for x in rows if x["recipe"] == "r4"]
    assert len(r4) == 8 and {x["world_size"] for x in r4} == {4}
    assert {x["mode"]: x["topology"] for x in r4} == {"ddp": "ring4", "pp": "chain4"}
    assert {x["batch_size"] for x in r4 if x["mode"] == "ddp"} == {2}  # 256 tokens over 4 ranks of 32
    res = [x for x in rows if x["recipe"].startswith("res")]
    assert {x["mode"] for x in res} == {"ddp"} and len(res) == 4
    # res shares plain's clean runs (it differs in link: alone): no BER-0 run of its own, its points pair with
    # plain's, and its residual is 1e-3 of the point's BER
    assert {(x["ber"], x["protected_ber"], x["baseline"]) for x in res if x["recipe"] == "res"} == {
        (1e-3, 1e-6, "ddp-ber0-tensor-fix-plain-s1"), (1e-3, 1e-6, "ddp-ber0-tensor-fix-plain-s2")}
    assert all(x["final_deviation"] is not None for x in res)
    assert all(x["bits_flipped"] > 0 for x in rows if x["ber"] > 0)
    md = (out / "report.md").read_text()
    assert md.index("## Where the published thresholds hold") < md.index("## Summary")
    line = next(x for x in md.splitlines() if x.startswith("| tiny | DDP | protect + residual | 4 | 2 |"))
    assert "—" not in line.split("|")[6]  # a measured interval: the shared clean runs are its baseline


@pytest.mark.parametrize("ok,fail,verdict", [(1e-9, 3e-9, "above"), (1e-12, 3e-12, "below"),
                                              (1e-11, 3e-11, "inside"), (None, 1e-12, "below"),
                                              (1e-9, None, "above"), (None, 1e-10, "inside")])
def test_fit_check_places_the_measurement_against_the_prediction(ok, fail, verdict):
    e = {"max_ok": ok, "min_fail": fail, "prediction": {"ber": 3e-11, "t": (1e-11, 1e-10)}}
    assert regime.fit_check(e) == verdict
    assert regime.fit_check({**e, "prediction": None}) is None


def test_reused_clean_runs_without_run_directories_run_again_for_the_points_that_need_them(tmp_path):
    """`reuse:` brings another experiment's rows, not its run directories; a control compared with a reused
    clean run needs that run's saved parameters, so the clean run trains again first (bit for bit the same: the
    same eval loss), and the control gets its deviation."""
    import json

    from conftest import ROOT, tb_cli

    pair = ROOT / "topologies" / "pair.yaml"
    text = f"""name: first
model: tiny
steps: 4
tokens_per_step: 128
topologies: {{ddp: {pair}}}
recipes:
  plain: {{ber: [1e-4]}}
grid: {{recipe: [plain], mode: [ddp], ber: [0], seed: [1, 2]}}
train: {{injector: process, seq_len: 32, eval_every: 2, eval_batches: 1, timeout: 60}}
"""
    (tmp_path / "first.yaml").write_text(text)
    r = tb_cli("run", str(tmp_path / "first.yaml"), "--out", str(tmp_path / "a"))
    assert r.returncode == 0, r.stderr[-3000:]
    first = {x["point"]: x for x in map(json.loads, (tmp_path / "a" / "results.jsonl").read_text().splitlines())}
    second = text.replace("name: first", "name: second\nreuse: [first]").replace(
        "  plain: {ber: [1e-4]}", "  plain: {ber: [1e-4]}\n  order: {baseline: plain, train: {perturb: order}}").replace(
        "recipe: [plain]", "recipe: [plain, order]")
    (tmp_path / "second.yaml").write_text(second)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "results.jsonl").write_text((tmp_path / "a" / "results.jsonl").read_text())
    r = tb_cli("run", str(tmp_path / "second.yaml"), "--out", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 clean runs have a row but no run directory" in r.stderr
    # the runner checks what it promises: each clean run trained again against its row, field by field
    assert r.stderr.count("the same run bit for bit as its row") == 2, r.stderr[-3000:]
    rows = {x["point"]: x for x in map(json.loads, (tmp_path / "b" / "results.jsonl").read_text().splitlines())}
    assert len(rows) == 6
    for seed in (1, 2):
        clean, ber = f"ddp-ber0-tensor-fix-plain-s{seed}", f"ddp-ber1e-4-tensor-fix-plain-s{seed}"
        assert rows[clean]["experiment"] == "second" and rows[ber]["experiment"] == "first"  # reused, not run
        assert rows[clean]["final_eval_loss"] == first[clean]["final_eval_loss"]  # the same run again
        control = rows[f"ddp-ber0-tensor-fix-order-s{seed}"]
        assert control["status"] == "ok" and control["final_deviation"] > 0


def test_a_provisional_threshold_is_marked_and_never_named_cheapest():
    rows = ladder("prot", [1e-5, 1e-4], [], protect="sign,exponent") + controls(0.5)
    th = thresholds(aggregate(rows), 0.01)
    for t in th.values():
        t["incomplete"] = (7, 9)  # as the report marks a recipe whose grid has not run to the end
    table = regime.regime_table(rows, th)
    (c,) = regime.cheapest(table)
    assert c["cheapest"] is None and c["provisional"] == ["protect"]
    md = "\n".join(paper_regime_section(rows, th))
    assert "≥ 1e-04 (provisional: 7 of 9 points)" in md and "protect (provisional, not counted)" in md


def test_a_pending_ber_is_neither_a_pass_nor_a_failure_in_the_table():
    """124M PP of docs/results/paper-regime stopped after one seed of its smallest BER: the table said "fails at
    every tested BER" and the fit check "inside the prediction's interval". With that BER pending (report's
    pending_points) the row says pending and claims no interval; a decided BER beside it still counts."""
    rows = ladder("a", [], []) + controls(0.5)
    rows += [row("a", "ddp", 1e-6, 1, 4.001, dev=1.0)]
    pend = {("a", "ddp", "tensor", "fix", 1e-6): (1, 3)}
    th = thresholds(aggregate(rows), 0.01, pending=pend)
    (e,) = regime.regime_table(rows, th)
    assert (e["max_ok"], e["min_fail"], e["verdict"]) == (None, None, "pending (no BER decided yet)")
    e["prediction"] = {"ber": 1e-6, "t": (1e-8, 1e-4)}
    assert regime.fit_check(e) is None
    md = "\n".join(paper_regime_section(rows, th))
    assert "pending: 1e-06 (1 of 3 seeds run)" in md and "fails" not in md and "inside" not in md
    # without the grid the lone seed fails (no bound): what the report showed
    assert table_of(rows)[1][0]["verdict"] == "fails at every tested BER"
    rows = ladder("a", [1e-7], []) + controls(0.5) + [row("a", "ddp", 1e-6, 1, 4.001, dev=1.0)]
    (e,) = regime.regime_table(rows, thresholds(aggregate(rows), 0.01, pending=pend))
    assert (e["max_ok"], e["min_fail"], e["pending"]) == (1e-7, None, {1e-6: {"run": 1, "of": 3, "of_clean": False}})
