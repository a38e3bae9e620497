"""Reproduce the importance-driven scheduler's headline comparison (004_91681cee0e4a4add.txt, Sec. 6).

Testbed S1 (Table 1): deepseek-moe-16b on an RTX 3080 Ti (12 GB) with 6 CPU cores. Model:
DeepSeek-V2-Lite-shaped synthetic traces (moesim/trace/synth.py, with scores and
``pred_next_layer``): the shipped preset closest to deepseek-moe-16b (both 64 routed experts,
top-6, 2 shared experts, hidden 2048, expert width 1408; 26 vs 27 MoE layers). Profile:
``rtx3090``, the shipped GPU closest to the 3080 Ti (the same GA102 chip, PCIe 4.0 x16, 912 vs
936 GB/s), with the testbed's own memory and core count set as overrides (``hw.gpu.memory_gib=12``
from the 3080 Ti spec sheet, ``hw.cpu.cores=6`` from Sec. 6.1); the cache then holds what
12 GB leaves. Router threshold alpha = 0.35, the paper's S1 setting (Sec. 6.2).

Claims (S1 stand-in; ``claim_id``: rows of benchmarks/reproduce/claims/004.yaml): TPOT of the best
baseline over ours at batch 3 (27%) and batch 1 (20%) (Sec. 6.2: "compared to the best baseline",
per setting and workload; moesim has llama.cpp, MoE-Infinity and HybriMoE of the paper's four, no
DeepSpeed), and the ablation at batch 1 (Sec. 6.3, Fig. 16): each of +CE, +ER, +Pre, +BA lowers TPOT
(by 8%, 20%, 14%, 34%, averaged over S1-S3 in the paper; S1 only here). Values are in the catalogue's
ratio form, TPOT before / TPOT after (a reduction p is 1 / (1 - p)); in this script's own table a row
agrees when moesim's ratio is above 1, like the paper's. The paper's testbeds (3080 Ti, 4060 Ti,
A6000) and S1/S2 models have no profile or preset and it states neither dtype nor lengths, so the
catalogue does not count these rows.

Run: ``.venv/bin/python benchmarks/reproduce/seed_004.py``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from moesim.analysis.metrics import metrics
from moesim.model.presets import load_preset
from moesim.policy.systems import SYSTEMS
from moesim.sim.run import simulate
from moesim.trace.synth import SynthConfig, synthesize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, testbed  # noqa: E402

PAPER = "004 importance-driven"
TESTBED_NAME = "rtx3090"  # with the fitted numbers of benchmarks/reproduce/calibration.yaml
TESTBED = {"hw.gpu.memory_gib": "12", "hw.cpu.cores": "6"}
ALPHA = {"substitute.alpha": "0.35"}
VS_BEST = {3: 0.27, 1: 0.20}  # S1 TPOT reduction over the best baseline (Sec. 6.2)
BASELINES = ("llamacpp", "moe-infinity", "hybrimoe")  # of the paper's four; moesim has no DeepSpeed
#: Fig. 16 steps: (label, settings of the importance system, paper's TPOT reduction over the previous step)
ABLATION = [
    ("baseline", {"cache": "static-first", "assign": "resident", "prefetch": "none", "substitute": "none"}, None),
    ("+CE", {"assign": "gpu", "prefetch": "none", "substitute": "none"}, 0.08),
    ("+ER", {"assign": "gpu", "prefetch": "none", **ALPHA}, 0.20),
    ("+Pre", {"assign": "gpu", **ALPHA}, 0.14),
    ("+BA", dict(ALPHA), 0.34),
]


def trace(workdir: Path, batch: int) -> str:
    path = workdir / f"ds-b{batch}.parquet"
    if not path.exists():
        synthesize(SynthConfig.from_settings(model=load_preset("deepseek-v2-lite"), requests=batch, prompt_len=16,
                                             decode_len=48, batch=batch, seed=4), path)
    return str(path)


def tpot(path: str, system: str, settings: dict) -> float:
    return metrics(simulate(path, testbed(TESTBED_NAME), system, {**TESTBED, **settings}))["tpot_ms_mean"]


def row(claim: str, paper_reduction: float, before: float, after: float, claim_id: str) -> dict:
    """A TPOT reduction in ratio form: before / after, the paper's p as 1 / (1 - p)."""
    paper, moesim = 1 / (1 - paper_reduction), before / after
    return {"paper": PAPER, "claim": claim, "paper_value": paper, "moesim_value": moesim,
            "ratio": moesim / paper, "agrees": bool(moesim > 1), "kind": "direction", "claim_id": claim_id}


def rows(workdir: str | None = None) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(workdir or tmp)
        out = []
        for batch, paper in VS_BEST.items():
            path = trace(work, batch)
            ours = tpot(path, "importance", ALPHA)
            theirs = {name: tpot(path, name, {}) for name in BASELINES if name in SYSTEMS}
            best = min(theirs, key=theirs.__getitem__)
            out.append(row(f"S1 batch {batch}: TPOT of the best baseline ({best}) / ours", paper, theirs[best], ours,
                           f"004-s62-s1-b{batch}-vs-best"))
        path = trace(work, 1)
        previous = None
        for label, settings, paper in ABLATION:
            value = tpot(path, "importance", settings)
            if previous is not None and paper is not None:
                out.append(row(f"ablation batch 1 {label}: TPOT of the previous step / this step", paper,
                               previous, value, f"004-f16-{label[1:].lower()}-tpot"))
            previous = value
        return out


def main() -> int:
    return print_table(rows)



if __name__ == "__main__":
    sys.exit(main())
