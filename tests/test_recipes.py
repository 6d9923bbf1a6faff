"""Training recipes: optimizer, schedule, clipping, guard, wire dtype, and the honest outcome of a run.

The recipe's pieces are checked in this process; the guards and the wire dtype on real 2-rank runs (tiny GPT-2,
loopback gloo, a few steps each) with the worker's test hooks: --debug-flip-step/--debug-flip-bit flip one bit
of the largest received value on the last rank, --debug-nan-step makes it NaN (DDP: in the allreduced
gradient of bucket 0; PP: in the activation received by stage 1).
"""

import math
import types

import numpy as np
import pytest
import torch

from testbed.experiments.training import summary_line
from testbed.train import recipe
from testbed.train.fingerprint import decode_sample
from testbed.train.launch import summarize_rows
from testbed.train.model import build_model
from testbed.train.settings import TrainSettings
from testbed.train.stages import WireCast, split_stages
from test_train import TINY, Spawner, rows_of, run

pytestmark = pytest.mark.timeout(240)

BASE = [*TINY, "--seed", "1"]  # tiny model, batch 4 x 32, eval every 4 steps (and before the first)


@pytest.fixture
def spawner():
    s = Spawner()
    yield s
    s.cleanup()


def settings(**kw):
    return TrainSettings(**{"mode": "ddp", "steps": 10, **kw})


def by(rows):
    return {(r["step"], r["rank"]): r for r in rows}


# ---- the recipe's pieces (in this process) ------------------------------------------------------------


def test_lr_schedules():
    constant = settings(lr=1e-3)
    assert [recipe.lr_at(s, constant) for s in (0, 5, 9)] == [1e-3] * 3
    warm = settings(lr=1e-3, warmup_steps=4)
    assert [recipe.lr_at(s, warm) for s in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    cos = settings(lr=1e-3, lr_schedule="cosine", warmup_steps=2)
    lrs = [recipe.lr_at(s, cos) for s in range(10)]
    assert lrs[:3] == pytest.approx([5e-4, 1e-3, 1e-3])  # warmup, then the cosine starts at lr
    assert lrs[-1] == pytest.approx(1e-4)  # 10% at the last step
    assert all(a > b for a, b in zip(lrs[2:], lrs[3:]))  # decreasing after warmup
    assert lrs[2 + 7 // 2] == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 3 / 7)))


def test_default_recipe_is_nanogpts():
    opt = recipe.make_optimizer(build_model("tiny", 0).parameters(), settings())
    assert isinstance(opt, torch.optim.AdamW)
    decayed, plain = opt.param_groups
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() < 2 for p in plain["params"])
    assert (decayed["weight_decay"], plain["weight_decay"], decayed["betas"], decayed["eps"]) == (0.1, 0.0,
                                                                                                (0.9, 0.95), 1e-8)
    sgd = recipe.make_optimizer(build_model("tiny", 0).parameters(), settings(optimizer="sgd", momentum=0.5))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.5


def test_clipping():
    def grads(values):
        p = torch.nn.Parameter(torch.zeros(len(values)))
        p.grad = torch.tensor(values)
        return [p]

    ps = grads([3.0, -4.0, 0.5])
    recipe.clip_(ps, settings(clip="value", grad_clip=1.0), None)
    assert ps[0].grad.tolist() == [1.0, -1.0, 0.5]
    ps = grads([3.0, -4.0, 0.0])
    recipe.clip_(ps, settings(clip="norm", grad_clip=1.0), torch.tensor(5.0))
    assert ps[0].grad.tolist() == pytest.approx([0.6, -0.8, 0.0])
    for off in (settings(clip="none"), settings(grad_clip=0.0)):
        ps = grads([3.0, -4.0])
        recipe.clip_(ps, off, torch.tensor(5.0))
        assert ps[0].grad.tolist() == [3.0, -4.0]


def test_sanitize_zeroes_what_is_not_plausible():
    t = torch.tensor([0.5, -2e3, float("nan"), float("inf"), 999.0, -1.0])
    clean, n = recipe.sanitize(t, 1e3)
    assert n == 3 and clean.tolist() == [0.5, 0.0, 0.0, 0.0, 999.0, -1.0]
    same, n = recipe.sanitize(torch.ones(4, dtype=torch.bfloat16), 1e3)
    assert n == 0
    assert recipe.sanitize(torch.tensor([float("-inf")], dtype=torch.float16), 1e3)[1] == 1


def test_frozen_values():
    p = torch.nn.Parameter(torch.zeros(6))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.ones(6)
    opt.step()
    assert recipe.frozen_values(opt) == 0
    opt.state[p]["exp_avg_sq"][:2] = torch.tensor([float("inf"), 2 * recipe.FROZEN_EXP_AVG_SQ])
    opt.state[p]["exp_avg"][2] = float("nan")
    with torch.no_grad():
        p[2:4] = float("nan")  # element 2 counted once
    assert recipe.frozen_values(opt) == 4


def test_wire_cast_carries_hidden_states_and_their_gradients_in_the_wire_dtype():
    first, last = split_stages(build_model("tiny", 0), 2)
    x = torch.randint(0, 512, (2, 16))
    h = WireCast(first, torch.bfloat16)(x)
    assert h.dtype == torch.bfloat16
    received = h.detach().requires_grad_(True)
    logits = WireCast(last, torch.bfloat16)(received)
    assert logits.dtype == torch.float32  # the loss is computed where it is: not on the wire
    logits.sum().backward()
    assert received.grad.dtype == torch.bfloat16  # the gradient the last stage sends back
    assert WireCast(first, torch.float32)(x).dtype == torch.float32


def test_summary_says_when_an_ok_run_made_no_progress():
    base = {"status": "ok", "steps_completed": 40, "steps_requested": 40, "final_loss": 6.2, "bits_flipped": 9,
            "bits_seen": 100, "initial_eval_loss": 6.24, "final_eval_loss": 6.23, "progress_basis": "eval"}
    line = summary_line({**base, "made_progress": False, "skipped_steps": 40})
    assert line.startswith("ok (no progress: 40/40 updates skipped): 40/40 steps"), line
    line = summary_line({**base, "made_progress": False, "skipped_steps": 0, "frozen_values": 12})
    assert line.startswith("ok (no progress: eval loss 6.2400 -> 6.2300)") and "frozen 12" in line, line
    assert summary_line({**base, "made_progress": True, "sanitized_values": 3}).startswith("ok: 40/40 steps")
    assert "sanitized 3" in summary_line({**base, "made_progress": True, "sanitized_values": 3})
    assert summary_line({**base, "status": "diverged", "made_progress": False}).startswith("diverged: ")
    # unknown progress (no eval, a NaN training loss at step 0) is not a plain ok either
    unknown = {**base, "made_progress": None, "initial_eval_loss": None, "progress_basis": "train"}
    assert summary_line(unknown).startswith("ok (progress unknown: no finite loss to compare): "), summary_line(unknown)


def test_outcome_fields_from_rows():
    def row(step, rank, **kw):
        return {"step": step, "rank": rank, "mode": "pp", "loss": 6.0 - step, "step_time_s": 0.1,
                "comm_time_s": 0.01, "skipped": step == 1, "sanitized": 2, "wire_bytes": 100 * (rank + 1),
                "frozen": None, "initial_eval_loss": 6.2 if step == 0 else None,
                "eval_loss": 5.0 if step == 3 else None, **kw}

    rows = [row(s, r, frozen=(3 if r else 1) if s == 3 else None) for s in range(4) for r in range(2)]
    out = summarize_rows(rows, 2)
    assert out["skipped_steps"] == 1 and out["lost_step_fraction"] == 0.25 and out["sanitized_values"] == 16
    assert out["frozen_values"] == 4  # PP: the stages' counts add up
    assert out["initial_eval_loss"] == 6.2 and out["made_progress"] is True and out["wire_bytes_per_step"] == 150
    ddp = summarize_rows([{**r, "mode": "ddp"} for r in rows], 2)
    assert ddp["frozen_values"] == 3  # DDP: the worst replica
    flat = summarize_rows([{**r, "eval_loss": 6.19 if r["step"] == 3 else None} for r in rows], 2)
    assert flat["made_progress"] is False  # less than 1% below
    # PP at a high BER without evals: NaN training losses (corrupted activations), every update skipped
    nan = [{**r, "loss": float("nan"), "skipped": True, "initial_eval_loss": None, "eval_loss": None} for r in rows]
    assert summarize_rows(nan, 2)["made_progress"] is False
    assert summarize_rows([{**r, "skipped": r["step"] != 2} for r in nan], 2)["made_progress"] is None


# ---- real runs ----------------------------------------------------------------------------------------


def test_skip_loses_the_step(spawner, tmp_path):
    """An exponent flip in a received gradient overflows the norm: every rank skips that update."""
    run_dir = str(tmp_path / "skip")
    s = run(spawner, run_dir, ["--mode", "ddp", "--steps", "6", *BASE, "--debug-flip-step", "2",
                               "--debug-flip-bit", "30"])
    assert s["status"] == "ok", s["reason"]
    assert s["skipped_steps"] == 1 and s["lost_step_fraction"] == pytest.approx(1 / 6)
    assert s["sanitized_values"] == 0 and s["frozen_values"] == 0 and s["made_progress"]
    rows = by(rows_of(run_dir))
    assert rows[(2, 1)]["corrupted_values"] == 1 and not math.isfinite(rows[(2, 1)]["grad_norm"])
    for rank in (0, 1):
        assert rows[(2, rank)]["skipped"]
        assert rows[(2, rank)]["param_sha256"] == rows[(1, rank)]["param_sha256"]  # unchanged by step 2
        assert rows[(3, rank)]["param_sha256"] != rows[(2, rank)]["param_sha256"]
        # fp32 on the wire: 4 bytes per gradient value
        assert rows[(0, rank)]["wire_bytes"] == 4 * rows[(0, rank)]["param_count"]


def test_none_lets_nan_reach_the_weights_and_diverges(spawner, tmp_path):
    run_dir = str(tmp_path / "none")
    s = run(spawner, run_dir, ["--mode", "ddp", "--steps", "8", *BASE, "--debug-nan-step", "2", "--guard", "none"])
    assert s["status"] == "diverged", s
    assert "non-finite loss at step 3" in s["reason"] and s["steps_completed"] == 4
    rows = by(rows_of(run_dir))
    assert not rows[(2, 1)]["skipped"] and not math.isfinite(rows[(2, 1)]["param_norm"])  # in the weights
    assert math.isfinite(rows[(2, 0)]["param_norm"])  # rank 0 received a clean sum at step 2...
    assert not math.isfinite(rows[(3, 0)]["param_norm"])  # ...and rank 1's NaN gradients at step 3
    assert s["frozen_values"] == rows[(3, 1)]["param_count"] and s["skipped_steps"] == 0
    assert not s["made_progress"]


def test_none_without_clipping_freezes_the_hit_element(spawner, tmp_path):
    """A ~1e36 gradient element squares to Inf in Adam's second moment: the element stops moving, for good."""
    run_dir = str(tmp_path / "frozen")
    s = run(spawner, run_dir, ["--mode", "ddp", "--steps", "6", *BASE, "--debug-flip-step", "2",
                               "--debug-flip-bit", "30", "--guard", "none", "--clip", "none"])
    assert s["status"] == "ok", s["reason"]
    assert s["skipped_steps"] == 0 and s["frozen_values"] == 1
    assert by(rows_of(run_dir))[(5, 0)]["frozen"] == 0  # rank 0 never saw it
    assert "frozen 1" in summary_line(s)


def test_sanitize_zeroes_the_flipped_gradient_and_keeps_training(spawner, tmp_path):
    run_dir = str(tmp_path / "sanitize")
    s = run(spawner, run_dir, ["--mode", "ddp", "--steps", "6", *BASE, "--debug-flip-step", "2",
                               "--debug-flip-bit", "30", "--guard", "sanitize"])
    assert s["status"] == "ok", s["reason"]
    assert s["skipped_steps"] == 0 and s["sanitized_values"] == 1 and s["made_progress"]
    rows = by(rows_of(run_dir))
    assert rows[(2, 1)]["sanitized"] == 1 and rows[(2, 1)]["corrupted_values"] == 1
    assert math.isfinite(rows[(2, 1)]["grad_norm"]) and not rows[(2, 1)]["skipped"]


@pytest.mark.parametrize("rank,received", [(1, "nonfinite_activations"), (0, "nonfinite_gradients")])
def test_sanitize_zeroes_a_nan_received_in_pp(spawner, tmp_path, rank, received):
    """Stage 1 receives activations, stage 0 their gradients: either way the NaN is zeroed on arrival."""
    run_dir = str(tmp_path / "pp")
    s = run(spawner, run_dir, ["--mode", "pp", "--microbatches", "2", "--steps", "6", *BASE,
                               "--debug-nan-step", "2", "--debug-rank", str(rank), "--guard", "sanitize"])
    assert s["status"] == "ok", s["reason"]
    assert s["skipped_steps"] == 0 and s["sanitized_values"] == 1
    rows = by(rows_of(run_dir))
    assert rows[(2, rank)][received] == 1 and rows[(2, rank)]["sanitized"] == 1
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows.values())


@pytest.mark.parametrize("mode", ["ddp", "pp"])
def test_bf16_wire_moves_half_the_bytes(spawner, tmp_path, mode):
    run_dir = str(tmp_path / mode)
    s = run(spawner, run_dir, ["--mode", mode, "--microbatches", "2", "--steps", "6", *BASE, "--wire-dtype", "bf16"])
    assert s["status"] == "ok", s["reason"]
    assert s["made_progress"]
    for r in rows_of(run_dir):
        if mode == "ddp":  # 2 bytes per gradient value; the bf16 reference agrees bit for bit
            assert r["wire_bytes"] == 2 * r["param_count"] and r["corrupted_values"] == 0
        else:  # activations (stage 1) and gradients (stage 0): batch 4 x 32 tokens x width 64, 2 bytes each
            assert r["wire_bytes"] == 2 * r["received_elements"] == 2 * 4 * 32 * 64
    assert s["wire_bytes_per_step"] == (2 * rows_of(run_dir)[0]["param_count"] if mode == "ddp" else 2 * 4 * 32 * 64)


def test_sgd_with_a_cosine_schedule(spawner, tmp_path):
    run_dir = str(tmp_path / "sgd")
    argv = ["--mode", "ddp", "--steps", "8", *BASE, "--optimizer", "sgd", "--lr", "0.5", "--lr-schedule", "cosine",
            "--warmup-steps", "2"]
    s = run(spawner, run_dir, argv)
    assert s["status"] == "ok", s["reason"]
    cfg = types.SimpleNamespace(lr=0.5, lr_schedule="cosine", warmup_steps=2, steps=8)
    lrs = [r["lr"] for r in rows_of(run_dir) if r["rank"] == 0]
    assert lrs == [recipe.lr_at(step, cfg) for step in range(8)]
    assert lrs[0] == 0.25 and lrs[1] == 0.5 and lrs[-1] == pytest.approx(0.05)
    assert s["frozen_values"] == 0 and s["made_progress"]


def test_value_clipping_bounds_every_update(spawner, tmp_path):
    """Plain SGD (no momentum, no decay) with lr 1: each parameter moves by its clamped gradient, at most
    grad_clip, and many gradients exceed it."""
    run_dir = str(tmp_path / "value")
    c = 1e-4
    s = run(spawner, run_dir, ["--mode", "ddp", "--steps", "4", *BASE, "--optimizer", "sgd", "--momentum", "0",
                               "--weight-decay", "0", "--lr", "1", "--clip", "value", "--grad-clip", str(c)])
    assert s["status"] == "ok", s["reason"]
    samples = [decode_sample(r["param_sample"]) for r in rows_of(run_dir) if r["rank"] == 0]
    steps = np.abs(np.diff(np.stack(samples), axis=0))
    assert steps.max() <= c * 1.001
    assert (steps > c * 0.999).mean() > 0.01  # clamped ones moved by exactly grad_clip

