"""Parameter fingerprints (bit identity, L2 norm, a fixed coordinate sample) and distances between runs.

The sample is the same set of flat coordinates for every run and seed of a model (it depends only on the
parameter count), so the L2 distance between two parameter vectors a, b of N coordinates is estimated from
the n sampled ones as sqrt(N/n * sum_i (a_i - b_i)^2) (unbiased for the squared distance). When both runs
saved final-rank{R}.pt the final distance is computed exactly.
"""

import base64
import hashlib
import math
from pathlib import Path

import numpy as np
import torch

from testbed.train.common import final_params_path, read_jsonl

SAMPLE_SEED = 20240607  # fixed on purpose: run seed must not change which coordinates are sampled


class Fingerprinter:
    """Fingerprints of a fixed list of parameter tensors (in a fixed order)."""

    def __init__(self, params, n_sample=4096):
        self.params = list(params)
        self.n_total = sum(p.numel() for p in self.params)
        n = min(n_sample, self.n_total)
        flat = np.sort(np.random.default_rng(SAMPLE_SEED).choice(self.n_total, size=n, replace=False))
        self.pieces, offset = [], 0  # (param, local flat indices) for params holding sampled coordinates
        for p in self.params:
            lo, hi = np.searchsorted(flat, [offset, offset + p.numel()])
            if hi > lo:
                self.pieces.append((p, torch.from_numpy(flat[lo:hi] - offset)))
            offset += p.numel()

    @torch.no_grad()
    def __call__(self, with_hash=True):
        sha = hashlib.sha256()
        sq = 0.0
        for p in self.params:
            t = p.detach().contiguous()
            if with_hash:
                sha.update(t.numpy().data)  # raw fp32 bytes: equal digests <=> bit-identical parameters
            sq += float(t.pow(2).sum())  # fp32 per tensor (vector_norm in fp32 loses ~0.2% on 38M elements)
        sample = torch.cat([p.detach().reshape(-1)[i] for p, i in self.pieces]).float().numpy()
        return {
            "param_sha256": sha.hexdigest() if with_hash else None,
            "param_norm": math.sqrt(sq),
            "param_count": self.n_total,
            "param_sample": encode_sample(sample),
        }


def encode_sample(values):
    """float32 little-endian bytes, base64: exact and 4x smaller than JSON numbers."""
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()


def decode_sample(text):
    return np.frombuffer(base64.b64decode(text), dtype="<f4")


def sample_distance(row_a, row_b):
    """Estimated L2 distance between two fingerprints (metrics rows) of the same model part."""
    a = decode_sample(row_a["param_sample"]).astype(np.float64)
    b = decode_sample(row_b["param_sample"]).astype(np.float64)
    if a.shape != b.shape or row_a["param_count"] != row_b["param_count"]:
        raise ValueError("fingerprints of different parameter sets")
    d = a - b
    with np.errstate(invalid="ignore", over="ignore"):
        return {
            "l2_estimate": math.sqrt(row_a["param_count"] / len(a) * float(np.sum(d * d))),
            "max_abs_diff_sampled": float(np.max(np.abs(d))) if len(d) else 0.0,
            "differing_fraction_sampled": float(np.mean(a.astype("<f4").view("<i4") != b.astype("<f4").view("<i4"))),
            "bit_identical": row_a.get("param_sha256") is not None
                             and row_a.get("param_sha256") == row_b.get("param_sha256"),
        }


def final_distance(path_a, path_b):
    """Exact L2 distance and bit identity between two saved state dicts (final-rank{R}.pt)."""
    sa, sb = torch.load(path_a, map_location="cpu"), torch.load(path_b, map_location="cpu")
    if sa.keys() != sb.keys():
        raise ValueError(f"{path_a} and {path_b} hold different parameters")
    sq, identical = 0.0, True
    for k in sa:
        a, b = sa[k], sb[k]
        identical &= torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                                 b.view(torch.int32) if b.dtype == torch.float32 else b)
        sq += float((a.double() - b.double()).pow(2).sum())
    return {"l2": math.sqrt(sq), "bit_identical": bool(identical)}


def _rows_by_rank(run_dir):
    rows = {}
    for path in sorted(Path(run_dir).glob("metrics-rank*.jsonl")):
        for r in read_jsonl(path):
            if "param_sample" in r:
                rows[(r["step"], r["rank"])] = r
    return rows


def run_distance(run_a, run_b):
    """Per (step, rank) estimated distance between two runs of the same model/mode/world size, plus the exact
    final distance per rank where both runs saved parameters."""
    ra, rb = _rows_by_rank(run_a), _rows_by_rank(run_b)
    per_step = [{"step": s, "rank": r, **sample_distance(ra[(s, r)], rb[(s, r)])}
                for (s, r) in sorted(ra.keys() & rb.keys())]
    final = {}
    for pa in sorted(Path(run_a).glob("final-rank*.pt")):
        pb = Path(run_b) / pa.name
        if pb.exists():
            final[int(pa.stem.removeprefix("final-rank"))] = final_distance(pa, pb)
    return {"per_step": per_step, "final": final}


def replica_divergence(run_dir):
    """DDP: how far each rank's replica is from rank 0's, per step (estimated) and at the end (exact)."""
    rows = _rows_by_rank(run_dir)
    ranks = sorted({r for _, r in rows})
    per_step = []
    for (s, r) in sorted(rows):
        if r != 0 and (s, 0) in rows:
            per_step.append({"step": s, "rank": r, **sample_distance(rows[(s, 0)], rows[(s, r)])})
    final = {}
    p0 = final_params_path(run_dir, 0)
    for r in ranks[1:]:
        pr = final_params_path(run_dir, r)
        if p0.exists() and pr.exists():
            final[r] = final_distance(p0, pr)
    return {"per_step": per_step, "final": final}


def bit_identical(run_a, run_b):
    """True if both runs logged the same (step, rank) fingerprints, all with equal sha256, and any final
    parameters both saved are equal bit for bit."""
    ra, rb = _rows_by_rank(run_a), _rows_by_rank(run_b)
    if not ra or ra.keys() != rb.keys():
        return False
    # Hashes are taken every --fingerprint-every steps (and always at the last): compare where both have one.
    hashed = [k for k in ra if ra[k].get("param_sha256") and rb[k].get("param_sha256")]
    if not hashed or any(ra[k]["param_sha256"] != rb[k]["param_sha256"] for k in hashed):
        return False
    return all(d["bit_identical"] for d in run_distance(run_a, run_b)["final"].values())

