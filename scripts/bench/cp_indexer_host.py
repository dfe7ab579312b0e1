# SPDX-License-Identifier: Apache-2.0
"""Stage 0001 on one GPU, host included: the whole indexer prefill op per
step, replicated vs each TP rank's share of the split, on serving steps.

The steps (``scripts.bench.serving_steps``): the six named ones the
planner was tuned on, and a seeded family of at least 30 it was not
(``--family N --seed S``), each at tp 2, 4 and 8. For each, vLLM's
metadata builder plans the step and the real
``rocm_aiter_sparse_attn_indexer`` of the applied tree runs it: once
replicated (the flag off), then once as each rank of the shipped split
(the flag on, the rank's id patched in; one GPU has no TP group, so the
merge's collective is replaced by its local part and not timed), and,
where the planner leaves the step replicated, split anyway
(``forced_split``), to show what that leaves. Per step, also:

- ``floor_ms``, F1: the op on one call holding only the step's costliest
  row (``floor_step``), with each top-k stand-in shape;
- ``merge_ms``: the merge modelled at H200 NVLink and MI355X xGMI
  bandwidths (``merge_ms``, with the stage's own ``MergeLink`` model).

Per call:

- GPU ms: CUDA events around the call, queued behind enough GPU work to
  cover the host's queueing (so small steps time the GPU, not the host),
  the worse of two medians of ``--runs`` calls; inputs and buffers are made
  before, untimed;
- host ms: wall time until the call returns, without waiting for the GPU
  (with no sync inside, the host runs ahead; a sync makes it wait). Each
  rank's calls run back to back, as a rank makes them layer after layer:
  its first call of the step makes the split's windows (``windows_ms``, its
  host time over the later calls'), timed apart from the rest, and the
  planner's own time per step (``plan_ms``) is timed on its own; a rank
  pays both once a step, a 61st of them a layer (``layer_host_ms``);
- syncs: synchronizing CUDA calls counted by
  ``torch.cuda.set_sync_debug_mode("warn")``.

With ``--key-split-all`` the planner key-splits every request it may
(``KEY_SPLIT_BY_MODEL`` off), to time that policy beside its model's. With
``--zigzag`` every step is also split in the zigzag layout (``ROW_LAYOUT``),
with its own merge and gate, and the report puts it beside the cost cuts.

Every split it runs is also checked: each simulated rank's rows, with the
exchange and the merge emulated between the ranks, against the replicated
op's by score (``cp_indexer_host_check``); a step whose rows differ ends
the run with its name (exit 1). ``--check-only`` checks the steps without
timing them (``cp_indexer_exactness.json``). The JSON records the
project's commit (``DSA_COMMIT`` where the copy has no git history), a
hash of stage 0001's modules as the run imports them, and per step and
link the gate's decision, which the report judges the run with.

With ``--calibrate`` or ``--variants`` it calibrates the planner's costs
before the steps and again after them (the run records the whole op's
per-call time, c, from each as ``call_ms``; G2 holds where it holds at
both): the logits
and top-k are timed on chunks of R rows of L keys each. The whole op on
chunks of 256 rows and more is fitted as ``ms = a R L + b R + c`` by least
squares: ``b / a`` is a row's fixed cost in key-rows (``ROW_COST_KEYS``),
``c / a`` a call's (``CALL_COST_KEYS``). The logits alone, with chunks of
a wave's worth of rows too, are fitted as ``ms = a max(R, W) L + b R + c``
for a few waves W (rows the GPU scores at once): the best W per compute
unit is the wave (``WAVE_ROWS_PER_CU``), their a over the whole op's the
logits' share (``LOGITS_SHARE``). The named steps then also run under
planner variants: the shipped costs without the wave floor, with half and
with twice the wave, the fitted costs, and the shipped costs again (the
run's noise).

ROCm is emulated as gfx950, where vLLM 0.34.0 asks AITER's logits for no
-inf fill. The logits and top-k are the fast stand-ins of
``scripts.harness.fast_indexer_kernels`` (a Triton fp8 MQA-logits kernel
on AITER's grid and a Triton radix top-k with the threads of AITER's
one-block kernel, or with ``--narrow-topk`` the bench's first, narrow one),
so that GPU time is not dominated by a reference kernel 10-100x slower than
AITER. Their times are NVIDIA times, not MI355X times.

With ``--crossover`` it sweeps small steps instead, the split forced on,
for the minimum split size (cp_indexer_min_split.json). With
``--topk-shapes`` it times only the logits and each top-k stand-in shape on
a few calls (cp_indexer_topk_shapes.json), to choose the shape first.

With ``--aiter`` (on an MI355X, against a built tree) nothing is emulated
or stood in: the op runs on the machine's own ROCm platform with AITER's
logits and top-k (``VLLM_ROCM_USE_AITER=1``), and the calibration times
AITER's logits and its prefill top-k, so the fits give MI355X's row, call
and wave costs.

The JSON is written after every step; ``--resume`` runs only the steps it
lacks, so a run cut short by a time limit goes on where it stopped.

This module runs the steps; the timing is ``cp_indexer_host_timing``, the
calibration ``cp_indexer_host_calibration``, and the reports and goals
``cp_indexer_host_report``.

Usage (on the device, under scripts/gpu_run.sh; see docs/gpu_runs.md):
    python3 -m scripts.bench.cp_indexer_host --out DIR [--resume]
    python3 -m scripts.bench.cp_indexer_host --crossover --out DIR
on an MI355X (docs/serving.md, "Stage 0001's host bench on an MI355X"):
    python3 -m scripts.bench.cp_indexer_host --aiter --tree TREE --out DIR
then, with the JSON files in docs/:
    python3 -m scripts.bench.cp_indexer_host --report docs
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from itertools import pairwise
from pathlib import Path

from scripts.bench import cp_indexer_host_timing as timing
from scripts.bench.common import (
    command_line,
    gpu_versions,
    parse_args,
    source_commit,
    use_tree,
)
from scripts.bench.cp_indexer_host_calibration import calibrate, topk_shapes
from scripts.bench.cp_indexer_host_check import RowsDiffer
from scripts.bench.cp_indexer_host_report import (
    LINKS,
    key_split_owners,
    report,
    splits_on,
)
from scripts.bench.cp_indexer_host_timing import (
    ZIGZAG,
    Costs,
    K,
    step_ms,
    time_step,
)
from scripts.bench.cp_indexer_min_split_report import crossover_report
from scripts.bench.serving_steps import NAMED, Step, family, named
from scripts.series.contract import TREE_ENV

TPS = (2, 4, 8)
# Set by --variants: the calibration, and planner variants on the named steps.
VARIANTS = False
# Set by --calibrate (and --variants): the calibration, whose call cost the
# run records as ``call_ms`` (G2's bound).
CALIBRATE = False
# The top-k stand-in's shape (fast_indexer_kernels.TOPK_SHAPES): "wide",
# AITER's 1,024 threads a row, since Triton's 12-bit histogram ("aiter")
# takes 8-23x as long on NVIDIA (docs/cp_indexer_topk_shapes.json);
# --narrow-topk sets the narrow one.
TOPK_SHAPE = "wide"
# Set by --resume: the steps the output's JSON holds already are not run again.
RESUME = False
# Set by --zigzag: every step also split in the zigzag layout, beside the
# shipped planner's cost cuts (``ROW_LAYOUT``).
ZIGZAG_TOO = False


# The minimum split size's sweep: small steps around it, split forced.
CROSSOVER: dict[str, list[tuple[int, int]]] = {
    **{f"fresh {n}K": [(0, n * K)] for n in (1, 2, 3, 4, 6, 8)},
    **{f"turn 256 over {p}K": [(p * K, 256)] for p in (8, 16, 32, 64)},
    "turn 64 over 15K + fresh 1K": [(15 * K, 64), (0, K)],
    "turn 1024 over 16K": [(16 * K, 1024)],
}


def crossover(runs: int) -> dict:
    """The CROSSOVER steps, split forced, at tp 2 and 8."""
    results = {}
    for name, step in CROSSOVER.items():
        for tp in TPS:
            result = time_step(step, tp, runs, {"shipped": None}, force_split=True)
            result["tp"], result["rows"] = tp, sum(q for _, q in step)
            results[f"{name} | tp {tp}"] = result
            print(name, tp, result, flush=True)
    return results


def main() -> int:
    if sys.argv[1:2] == ["--report"]:
        docs = Path(sys.argv[2])
        # The modelled balance is the planner's own RankCost: vLLM's, from
        # the tree (its absence is a clear exit, not an import traceback).
        tree = os.environ.get(TREE_ENV)
        use_tree(Path(tree) if tree else None)
        (docs / "cp_indexer_host_bench.md").write_text(report(docs))
        if (docs / "cp_indexer_min_split.json").exists():
            (docs / "cp_indexer_min_split.md").write_text(crossover_report(docs))
        return 0
    global VARIANTS, CALIBRATE, TOPK_SHAPE, RESUME, ZIGZAG_TOO
    if "--aiter" in sys.argv:
        sys.argv.remove("--aiter")
        timing.ON_AITER = True
    if "--variants" in sys.argv:
        sys.argv.remove("--variants")
        VARIANTS = True
    if "--zigzag" in sys.argv:
        sys.argv.remove("--zigzag")
        ZIGZAG_TOO = True
    if "--calibrate" in sys.argv:
        sys.argv.remove("--calibrate")
        CALIBRATE = True
    if "--key-split-all" in sys.argv:
        sys.argv.remove("--key-split-all")
        timing.KEY_SPLIT_ALL = True
    if "--resume" in sys.argv:
        sys.argv.remove("--resume")
        RESUME = True
    if "--check-only" in sys.argv:
        sys.argv.remove("--check-only")
        timing.CHECK_ONLY = True
    if "--narrow-topk" in sys.argv:
        sys.argv.remove("--narrow-topk")
        TOPK_SHAPE = "narrow"
    if "--crossover" in sys.argv:
        sys.argv.remove("--crossover")
        return _run_crossover()
    if "--topk-shapes" in sys.argv:
        sys.argv.remove("--topk-shapes")
        args = parse_args(__doc__, runs=5)
        args.out.mkdir(parents=True, exist_ok=True)
        payload = {
            "command": _command("--topk-shapes"),
            "versions": gpu_versions(),
            "results": topk_shapes(args.runs),
        }
        (args.out / "cp_indexer_topk_shapes.json").write_text(
            json.dumps(payload, indent=1) + "\n"
        )
        return 0
    try:
        return _run_steps()
    except RowsDiffer as error:
        print(f"exactness check failed: {error}", file=sys.stderr)
        return 1


def _command(*flags: str) -> str:
    """This run's command line, with the flags ``main`` took out of it."""
    taken = (
        *flags,
        *(["--aiter"] if timing.ON_AITER else []),
        *(["--variants"] if VARIANTS else []),
        *(["--zigzag"] if ZIGZAG_TOO else []),
        *(["--calibrate"] if CALIBRATE else []),
        *(["--key-split-all"] if timing.KEY_SPLIT_ALL else []),
        *(["--narrow-topk"] if TOPK_SHAPE == "narrow" else []),
        *(["--check-only"] if timing.CHECK_ONLY else []),
        *(["--resume"] if RESUME else []),
    )
    return " ".join([command_line("scripts.bench.cp_indexer_host"), *taken])


def _run_crossover() -> int:
    args = parse_args(__doc__, runs=20)
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": _command("--crossover"),
        "versions": gpu_versions(),
        "kernels": "aiter" if timing.ON_AITER else "stand-ins",
        "results": crossover(args.runs),
    }
    (args.out / "cp_indexer_min_split.json").write_text(
        json.dumps(payload, indent=1) + "\n"
    )
    return 0


def floor_step(step: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """A step whose one call holds only ``step``'s costliest row: the
    last two rows of its request with the most keys (a request of one new
    token would be a decode to vLLM's builder)."""
    cached, new = max(step, key=lambda request: request[0] + request[1])
    return [(cached + new - 2, 2)]


def measure_floor(step: list[tuple[int, int]], runs: int) -> dict[str, float]:
    """F1: the op's time (``step_ms``) on ``floor_step(step)``, replicated,
    with each top-k stand-in shape (with --aiter, AITER's own kernel, as
    "aiter"). Its call of two rows takes AITER's multi-block top-k for rows
    of 64K keys and more (``uses_multi_block``), as AITER would."""
    from scripts.harness import fast_indexer_kernels as fast

    shapes = ["aiter"] if timing.ON_AITER else list(fast.TOPK_SHAPES)
    shipped_shape, floors = fast.TOPK_SHAPE, {}
    try:
        for shape in shapes:
            fast.TOPK_SHAPE = shape
            run = time_step(floor_step(step), 2, runs, {})
            floors[shape] = step_ms(run["replicated"])
    finally:
        fast.TOPK_SHAPE = shipped_shape
    return floors


def merge_ms(split: dict, narrow: bool = False) -> dict[str, float]:
    """The merge's and the key split's exchange's modelled ms per link for
    a split as the run recorded it (its bounds and key-split rows' owners:
    the stage's own ``links_key_rows``, its rows int16 where ``narrow``)."""
    from vllm.v1.attention.ops import rocm_cp_indexer_plan as plan

    sizes = [b - a for a, b in pairwise(split["bounds"])]
    owners = key_split_owners(split)
    return {
        name: plan.links_key_rows(getattr(plan, link), sizes, narrow, owners)
        * plan.NS_PER_KEY_ROW
        / 1e6
        for name, link in LINKS.items()
    }


def _variants(runs: int) -> tuple[dict, dict[str, Costs | None]]:
    """With --variants: the calibration and the planner variants it sets
    (``report``'s columns); else none and the shipped planner alone."""
    from vllm.v1.attention.ops import rocm_cp_indexer_plan

    zigzag: dict[str, Costs | None] = {ZIGZAG: None} if ZIGZAG_TOO else {}
    if not (VARIANTS or CALIBRATE):
        return {}, {"shipped": None, **zigzag}
    calibration = calibrate(runs)
    if not VARIANTS:
        return calibration, {"shipped": None, **zigzag}
    fit = calibration["fit"]
    wave = calibration["wave"]
    shipped: Costs = (
        rocm_cp_indexer_plan.ROW_COST_KEYS,
        rocm_cp_indexer_plan.CALL_COST_KEYS,
        rocm_cp_indexer_plan.WAVE_ROWS_PER_CU,
        rocm_cp_indexer_plan.LOGITS_SHARE,
    )
    values: dict[str, Costs] = {
        "shipped": shipped,
        "no wave floor": (*shipped[:2], 0, shipped[3]),
        # How much the wave's size matters: MI355X's is not measured.
        "half the wave": (*shipped[:2], shipped[2] / 2, shipped[3]),
        "twice the wave": (*shipped[:2], shipped[2] * 2, shipped[3]),
        "fitted": (
            fit["row_cost_keys"],
            fit["call_cost_keys"],
            wave["wave_rows_per_cu"],
            wave["logits_share"],
        ),
    }
    # One run per distinct set of costs, named by the first variant with it.
    variants: dict[str, Costs | None] = {}
    for name, value in values.items():
        if value not in variants.values():
            variants[name] = value
    # The shipped planner twice: the spread between the two is the noise.
    variants["shipped, timed again"] = variants["shipped"]
    return calibration, variants | zigzag


def bench_step(step: Step, runs: int, variants: dict[str, Costs | None]) -> dict:
    """One step at each of TPS: the op replicated (timed once: it does not
    depend on tp), split as the shipped planner (and ``variants``) plans it,
    and, where the plan stays replicated, split anyway (``forced_split``),
    to show what it leaves; F1 (``floor_ms``) and the merge modelled per
    link (``merge_ms``, of the shipped split or else the forced one).
    With --check-only, only the splits' exactness check."""
    try:
        return _bench_step(step, runs, variants)
    except RowsDiffer as error:
        raise RowsDiffer(f"{step.name}: {error}") from None


def _bench_step(step: Step, runs: int, variants: dict[str, Costs | None]) -> dict:
    if timing.CHECK_ONLY:
        results = {}
        for tp in TPS:
            result = time_step(step.prefills, tp, runs, variants, replicated=False)
            results[f"{step.name} | tp {tp}"] = result | {
                "step": step.prefills,
                "tp": tp,
            }
            checked = {
                name: s and s["checked_rows"] for name, s in result["split"].items()
            }
            print(step.name, tp, "rows checked:", checked, flush=True)
        return results
    floors = measure_floor(step.prefills, runs)
    replicated = None
    results = {}
    for tp in TPS:
        result = time_step(
            step.prefills, tp, runs, variants, replicated=replicated is None
        )
        replicated = result.setdefault("replicated", replicated)
        taken = result["split"]["shipped"]
        if taken is None:
            forced = time_step(
                step.prefills,
                tp,
                runs,
                {"shipped": None},
                force_split=True,
                replicated=False,
            )
            taken = result["forced_split"] = forced["split"]["shipped"]
        result |= {
            "step": step.prefills,
            "decodes": step.decodes,
            "tp": tp,
            "rows": sum(q for _, q in step.prefills),
            "floor_ms": floors,
            "merge_ms": None if taken is None else merge_ms(taken, result["narrow"]),
        }
        if taken is not None:
            # The gate's decision per link, by the planner that ran: the
            # report judges the run with it.
            result["gate"] = splits_on(result, taken)
        for name, split in result["split"].items():
            if name != "shipped" and split is not None:  # a variant's own
                split["merge_ms"] = merge_ms(split, result["narrow"])
                split["gate"] = splits_on(result, split)
        results[f"{step.name} | tp {tp}"] = result
        print(step.name, tp, json.dumps(result), flush=True)
    return results


def _run_steps() -> int:
    args = parse_args(__doc__, runs=5, family=30, seed=0)
    from scripts.harness import fast_indexer_kernels as fast

    fast.TOPK_SHAPE = TOPK_SHAPE
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / (
        "cp_indexer_exactness.json"
        if timing.CHECK_ONLY
        else "cp_indexer_host_bench.json"
    )
    from vllm.v1.attention.ops import rocm_cp_indexer_plan

    setup = {
        "kernels": "aiter" if timing.ON_AITER else "stand-ins",
        "topk_shape": "aiter" if timing.ON_AITER else TOPK_SHAPE,
        "family": {"count": args.family, "seed": args.seed},
        # What the shipped planner planned with, for the modelled balance.
        "planner_costs": [
            rocm_cp_indexer_plan.ROW_COST_KEYS,
            rocm_cp_indexer_plan.CALL_COST_KEYS,
            rocm_cp_indexer_plan.WAVE_ROWS_PER_CU,
            rocm_cp_indexer_plan.LOGITS_SHARE,
        ],
        "compute_units": timing.compute_units(),
        "key_split": "every candidate" if timing.KEY_SPLIT_ALL else "by model",
        "zigzag": ZIGZAG_TOO,
        # Every split step's rows are checked against the replicated op's
        # (``cp_indexer_host_check``): a run that ends has passed it.
        "exactness_checked": True,
        "commit": source_commit(),
        "overlay_sha256": overlay_sha256(),
    }
    if RESUME and out.exists():
        payload = json.loads(out.read_text())
        differs = [key for key, value in setup.items() if payload.get(key) != value]
        had_variants = len(set(payload["variants"]) - {ZIGZAG}) > 1
        calibrated = bool(payload["calibration"])
        if differs or had_variants != VARIANTS or calibrated != (VARIANTS or CALIBRATE):
            raise SystemExit(
                f"{out} was run with other settings ({', '.join(differs) or 'variants'}"
                "): resume it with the same flags, or move it away"
            )
        payload.setdefault("resumed_by", []).append(_command())
    else:
        calibration, variants = _variants(args.runs)
        payload = {
            "command": _command(),
            "versions": gpu_versions(),
            **setup,
            "calibration": calibration,
            # c, a call's fixed time (the whole op's fit), for G2's bound:
            # fitted again after the steps (``calibration_again``).
            "call_ms": [call_ms(calibration)] if calibration else 0.0,
            "variants": variants,
            "results": {},
        }
    variants = payload["variants"]
    for step in [*named(), *family(args.family, args.seed)]:
        if all(f"{step.name} | tp {tp}" in payload["results"] for tp in TPS):
            continue  # measured by the run this one resumes
        # Planner variants on the named steps only: the family is the
        # shipped planner's test (and the zigzag layout's, beside it).
        family_variants = {
            name: variants[name] for name in ("shipped", ZIGZAG) if name in variants
        }
        payload["results"] |= bench_step(
            step, args.runs, variants if step.name in NAMED else family_variants
        )
        # After every step: a run stopped by a time limit resumes from here.
        _write(payload, out)
    if payload["calibration"] and len(payload["call_ms"]) < 2:
        payload["calibration_again"] = calibrate(args.runs)
        payload["call_ms"].append(call_ms(payload["calibration_again"]))
        _write(payload, out)
    return 0


def _write(payload: dict, out: Path) -> None:
    """The run's JSON, whole (a kill mid-write leaves the last one)."""
    partial = out.with_name(out.name + ".partial")
    partial.write_text(json.dumps(payload, indent=1) + "\n")
    partial.replace(out)


def call_ms(calibration: dict) -> float:
    """c, a call's fixed time in ms, as the calibration fitted the whole
    op. The run fits it twice, before its steps and after: G2 holds only
    where it holds at both (the fit moves with the host's noise)."""
    return calibration["fit"]["total"]["us_per_call"] / 1e3


def overlay_sha256() -> str:
    """A hash of stage 0001's modules as this run imports them from the
    tree (``rocm_cp_indexer*.py``, in name order): what was measured."""
    from vllm.v1.attention.ops import rocm_cp_indexer

    digest = hashlib.sha256()
    for path in sorted(
        Path(rocm_cp_indexer.__file__).parent.glob("rocm_cp_indexer*.py")
    ):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


if __name__ == "__main__":
    sys.exit(main())
