# SPDX-License-Identifier: Apache-2.0
"""The host bench's report: docs/cp_indexer_host_bench.md from its run's
JSON, and the goals each step is held to (``step_goals``), judged with the
stage's own gate and merge model per link."""

from __future__ import annotations

import json
import statistics
from itertools import pairwise
from pathlib import Path

from scripts.bench.cp_indexer_host_calibration import (
    CALIBRATION_KEYS,
    CALIBRATION_ROWS,
    WAVE_KEYS,
    WAVE_SAMPLES_PER_CU,
)
from scripts.bench.cp_indexer_host_timing import ZIGZAG, Costs, rank_ms, step_ms
from scripts.bench.serving_steps import LONG_TURNS, NAMED


def modelled_balance(
    step: list[tuple[int, int]],
    bounds: list[int],
    costs: Costs,
    runs: list[tuple[int, int, int]],
    units: int,
) -> float:
    """max/mean rank cost of a split as its planner scored it, with the
    planner's own ``RankCost`` (gfx950: a row of a request with C cached
    tokens costs C + t + 1 keys, t its index among the request's new rows,
    plus the row cost)."""
    import torch

    from vllm.v1.attention.ops import rocm_cp_indexer_cuts

    row_cost, call_cost, wave, share = costs
    rows = torch.tensor([c + t + 1 + row_cost for c, q in step for t in range(q)])
    before = torch.zeros(rows.numel() + 1, dtype=torch.int64)
    torch.cumsum(rows, 0, out=before[1:])
    ranks = rocm_cp_indexer_cuts.RankCost(
        before,
        torch.tensor([q for _, q in step]),
        [tuple(run) for run in runs],
        call_cost,
        int(wave * units),
        logits_share=share,
    ).of(bounds)
    return max(ranks) / statistics.mean(ranks)


def balance(
    entry: dict | None,
    replicated: dict,
    step: list[tuple[int, int]],
    costs: Costs,
    runs: list[tuple[int, int, int]],
    units: int,
) -> tuple[str, str, str, str]:
    """A split's slowest-rank GPU ms, max/mean rank GPU time (measured, and
    modelled) and speedup (replicated GPU ms over the slowest rank's), as
    table cells."""
    if entry is None:
        return "replicated", "-", "-", "1.00"
    ranks = entry["per_rank_gpu_ms"]
    return (
        f"{max(ranks):.2f}",
        f"{max(ranks) / statistics.mean(ranks):.3f}",
        f"{modelled_balance(step, entry['bounds'], costs, runs, units):.3f}",
        f"{replicated['gpu_ms'] / max(ranks):.2f}",
    )


def _fit_table(fit: dict) -> list[str]:
    """A fit's coefficients per kernel, as table lines."""
    lines = [
        "| kernel | a: ns per key-row | b: ns per row | c: us per call | "
        "worst relative error |",
        "|---|---:|---:|---:|---:|",
    ]
    for part in ("logits_ms", "topk_ms", "total"):
        f = fit[part]
        lines.append(
            f"| {part.removesuffix('_ms')} | {f['ns_per_key_row']:.4f} | "
            f"{f['ns_per_row']:.1f} | {f['us_per_call']:.1f} | "
            f"{f['worst_relative_error']:.1%} |"
        )
    return lines


def report(docs: Path) -> str:
    """docs/cp_indexer_host_bench.md from the run's JSON."""
    run = json.loads((docs / "cp_indexer_host_bench.json").read_text())
    on_aiter = run.get("kernels") == "aiter"
    lines = [
        "# CP indexer on one GPU, host included: split vs replicated",
        "",
        "Per serving step and tp, the whole `rocm_aiter_sparse_attn_indexer` "
        "call (vLLM's builder plans the step, "
        + ("on this machine's ROCm" if on_aiter else "ROCm emulated as gfx950")
        + "): "
        "replicated (flag off), and each TP rank's share of the split (flag "
        "on; one GPU runs each rank's share in turn, and the merge's "
        "collective is not timed). Each rank's calls run back to back, "
        "as a rank makes them layer after layer.",
        "",
        (
            "Logits and top-k are AITER's, as vLLM's ROCm op calls them "
            "(`--aiter`); the calibration times AITER's prefill top-k."
            if on_aiter
            else "Logits and top-k are the fast stand-ins of "
            "`scripts/harness/fast_indexer_kernels.py`: a Triton fp8 MQA-logits "
            "kernel that leaves positions outside a row's range unwritten "
            "(vLLM 0.34.0 asks AITER for `clean_logits=False` on gfx950), one "
            "program per row as AITER's gfx950 kernel, and a Triton radix top-k "
            "that reads only each row's range, one program per row or, where "
            "AITER's rule takes its multi-block kernel, several, in the "
            f"*{run.get('topk_shape', 'narrow')}* shape (`TOPK_SHAPES`). Their "
            "times are NVIDIA GPU times, not MI355X times."
        ),
        "",
        f"Hardware and versions: {run['versions']}. Command: `{run['command']}`.",
        "",
    ]
    if "family" not in run:
        lines += [
            "This run predates the family of steps, F1 and the bench's timing "
            "hygiene: each figure is one median of the calls, timed from an "
            "idle GPU with the harness's K-cache copy and top-k buffer fill "
            "inside the events.",
            "",
        ]
    if run["calibration"]:
        lines += _calibration_section(run)
    if any("floor_ms" in result for result in run["results"].values()):
        lines += _goals_section(run)
    if len(set(run.get("variants", {})) - {ZIGZAG}) > 1:
        lines += _variants_section(run)
    if ZIGZAG in run.get("variants", {}):
        lines += _layouts_section(run)
    return "\n".join(lines).rstrip("\n") + "\n"


def _calibration_section(run: dict) -> list[str]:
    fit, wave = run["calibration"]["fit"], run["calibration"]["wave"]
    on_aiter = run.get("kernels") == "aiter"
    return [
        "## The costs, calibrated",
        "",
        ("AITER's kernels" if on_aiter else "The stand-ins")
        + " timed on chunks of R rows of L keys each "
        f"(R in {list(CALIBRATION_ROWS)}, L in {list(CALIBRATION_KEYS)}, "
        "R L <= 2^28; and R a wave's worth of rows for each of "
        f"{list(WAVE_SAMPLES_PER_CU)} rows per compute unit, L in "
        f"{list(WAVE_KEYS)}; {run['calibration']['compute_units']} compute "
        "units), the whole op fitted as ms = a R L + b R + c on the chunks "
        f"of {list(CALIBRATION_ROWS)} rows:",
        "",
        *_fit_table(fit),
        "",
        f"A row's fixed cost is b / a = {fit['row_cost_keys']} key-rows, a "
        f"call's c / a = {fit['call_cost_keys']:,}.",
        "",
        "The logits alone fitted as ms = a max(R, W) L + b R + c, for each "
        "wave W tried (W rows per compute unit):",
        "",
        "| W per compute unit | W | logits' worst relative error |",
        "|---:|---:|---:|",
        *(
            f"| {f['wave_rows_per_cu']} | {f['wave_rows']} | "
            f"{f['logits_ms']['worst_relative_error']:.1%} |"
            for f in run["calibration"]["waves"]
        ),
        "",
        f"The fit with the least error, W = {wave['wave_rows']} "
        f"({wave['wave_rows_per_cu']} per compute unit):",
        "",
        *_fit_table(wave),
        "",
        "The logits' share of a key-row's cost (their a over the whole op's): "
        f"{wave['logits_share']}.",
        "",
    ]


# The goals the shipped planner is held to on every step and tp.
# G1: a split step's (slowest rank + merge) / replicated at most this ...
G1_SPLIT = 0.95
# ... and a step left replicated would, split, gain less than 10%.
G1_LEFT = 0.90
# G2: a split step's slowest rank within this of its bound, per tp.
G2_BOUND = {2: 1.10, 4: 1.20, 8: 1.20}
# G3: at tp 8, a step of this many key-rows or more, end to end on each link.
G3_KEY_ROWS, G3_SPEEDUP = 100_000_000, 5.0


def step_goals(
    result: dict,
    floor_shape: str,
    call_ms: float | list[float] = 0.0,
    variant: str = "shipped",
) -> dict:
    """G1, G2 and G3 of one step at one tp (``result`` as ``bench_step``
    makes it): per link the split's (slowest rank + merge) / replicated, the
    bound LB = max((replicated - c) / tp + c, F1, H), c a call's fixed time
    (``call_ms``, the run's calibrations: G2 holds only where it holds at
    each) and H the replicated call's host time, and the slowest rank over
    it, and whether each goal holds, on each link with the stage's gate for
    that link as the run recorded it (G2: None for a step left replicated on
    both; G3: None but for steps of G3_KEY_ROWS or more at tp 8). A call's
    time is ``rank_ms``: the longer of its GPU and host times, the host's
    with its share of the step's plan and windows. ``variant``: the
    planner variant judged (one the run timed on the step); where it left
    the step replicated, the shipped planner's split (or its forced one)
    stands for it, judged by the gate on that split."""
    replicated = step_ms(result["replicated"])
    shipped = result["split"][variant]
    split = shipped or result.get("forced_split") or result["split"]["shipped"]
    tp = result["tp"]
    if split is None:  # no split of its rows exists at this tp
        return {"split": False, "g1": True, "g2": None, "g3": None}
    ranks = rank_ms(split)
    slowest = max(ranks)
    merge = split.get("merge_ms") or result["merge_ms"]
    ratios = {link: (slowest + ms) / replicated for link, ms in merge.items()}
    # Per link, the gate's decision: the timed split is the same plan. Runs
    # before the bench recorded it: the gate of the tree the report runs on.
    splits = split.get("gate") or result.get("gate") or splits_on(result, split)
    host = result["replicated"]["host_ms"]
    bounds = [
        max((replicated - c) / tp + c, result["floor_ms"][floor_shape], host)
        for c in (call_ms if isinstance(call_ms, list) else [call_ms])
    ]
    g3 = None
    if tp == 8 and result.get("cost_key_rows", 0) >= G3_KEY_ROWS:
        g3 = all(
            splits[link] and 1 / ratio >= G3_SPEEDUP for link, ratio in ratios.items()
        )
    over = max(slowest / bound for bound in bounds)
    return {
        "split": shipped is not None,
        "splits": splits,
        "slowest_ms": slowest,
        "balance": slowest / statistics.mean(ranks),
        "bounds": split["bounds"],
        "bound_ms": min(bounds),
        "over_bound": over,
        "ratios": ratios,
        "g1": all(
            ratios[link] <= G1_SPLIT if splits[link] else ratios[link] >= G1_LEFT
            for link in ratios
        ),
        "g2": over <= G2_BOUND[tp] if any(splits.values()) else None,
        "g3": g3,
        "key_split": split.get("key_split", []),
    }


def _calls(run: dict) -> str:
    """The run's calibrated call times c, in ms."""
    calls = run.get("call_ms", 0.0)
    return " and ".join(
        f"{c:.3f}" for c in (calls if isinstance(calls, list) else [calls])
    )


def _mark(holds: bool | None) -> str:
    return "-" if holds is None else ("yes" if holds else "**no**")


def _goals_section(run: dict) -> list[str]:
    shape = run.get("topk_shape", "narrow")
    family = run.get("family", {})
    planned = (len(NAMED) + family.get("count", 0)) * 3
    cut_short = (
        [
            f"**This run was cut short by its time limit: {len(run['results'])} "
            f"of its {planned} step-tps.** `--resume` with the same flags "
            "completes it.",
            "",
        ]
        if family and len(run["results"]) < planned
        else []
    )
    lines = [
        "## Never slower (G1), near its bound (G2) and 5x at tp 8 (G3)",
        "",
        *cut_short,
        f"The six named steps and a family of {family.get('count')} serving "
        f"steps drawn with seed {family.get('seed')} "
        "(`scripts/bench/serving_steps.py`), at each tp. Every GPU figure is "
        "the worse of two medians, and a call's time the longer of its GPU "
        "and host times (in a forward of 61 indexer layers without syncs the "
        "host runs ahead, so the longer sets the pace); a rank's host time "
        "is its call's and a 61st of the step's plan and windows, which it "
        "makes once a step (runs before they were timed apart: the call's "
        "alone, the windows made again at every call). The split timed is "
        "the shipped planner's plan, or for a step it leaves replicated the "
        "same plan forced; *plan* says, per link, whether the stage's gate "
        "(`split_repays`, with that link's `MergeLink`) splits the step "
        "(*split*) or leaves it replicated (*left*), as the run recorded "
        "it (runs before it did: the gate of the tree the report runs on). "
        "F1: the op on one call holding only the step's costliest row, with "
        f"each top-k shape; LB takes the run's, *{shape}*. "
        "LB = max((replicated - c) / tp + c, F1, H), H the replicated "
        "call's host time and c a call's fixed time from each of the run's "
        f"calibrations ({_calls(run)} ms; 0 in runs before it was recorded): "
        "LB and slowest / LB are listed at the c that is hardest on G2, "
        "which holds only where it holds at each c. "
        "Merge: modelled (H200 NVLink from the 2x H200 all_gather fit, "
        "MI355X xGMI from its link bandwidth; `MergeLink`), not timed. "
        f"G1, on each link: a split step's (slowest + merge) / replicated <= "
        f"{G1_SPLIT}; a step left replicated >= {G1_LEFT}, split. G2: a step "
        "split on either link: its slowest rank <= "
        + ", ".join(f"{b} x LB at tp {tp}" for tp, b in G2_BOUND.items())
        + f". G3: at tp 8, a step of {G3_KEY_ROWS / 1e6:.0f}M key-rows or more "
        f"split on both links and at least {G3_SPEEDUP}x end to end on each. "
        "Key-split: the rows every rank scores over its part of their keys "
        "(their exchange is in the merge's ms). "
        "Decodes take their tokens of the step's budget and are not run "
        "(the same work on every rank, replicated or split).",
        "",
        "max/mean: the ranks' times, measured / as the planner modelled "
        "them (`modelled_balance`, with the costs the run planned with).",
        "",
        "| step | tp | M key-rows | replicated ms | plan, NVLink / xGMI | "
        "slowest rank ms | "
        "max/mean | F1 ms | LB ms | slowest / LB | merge ms NVLink / xGMI | "
        "(slowest + merge) / replicated, NVLink / xGMI | key-split rows | "
        "G1 | G2 | G3 |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    held: dict[str, list[bool]] = {"g1": [], "g2": [], "g3": []}
    call_ms = run.get("call_ms", 0.0)
    ordered = sorted(run["results"].items(), key=lambda kv: kv[1]["tp"])
    for key, result in ordered:
        name = key.split(" | tp ")[0]
        goals = step_goals(result, shape, call_ms)
        held["g1"].append(goals["g1"])
        for goal in ("g2", "g3"):
            if goals[goal] is not None:
                held[goal].append(goals[goal])
        floors = " / ".join(f"{ms:.2f}" for ms in result["floor_ms"].values())
        if "slowest_ms" not in goals:
            lines.append(
                f"| {name} | {result['tp']} | {result['cost_key_rows'] / 1e6:.0f} | "
                f"{step_ms(result['replicated']):.2f} | none | - | - | {floors} | "
                "- | - | - | - | - | yes | - | - |"
            )
            continue
        merge = " / ".join(f"{ms:.2f}" for ms in result["merge_ms"].values())
        key_split = sum(b - a for a, b in goals["key_split"])
        modelled = "-"
        if not key_split:  # the whole-row model
            modelled = "{:.3f}".format(
                modelled_balance(
                    result["step"],
                    goals["bounds"],
                    tuple(run["planner_costs"]),
                    result["runs"],
                    run["compute_units"],
                )
            )
        ratios = " / ".join(f"{r:.2f}" for r in goals["ratios"].values())
        lines.append(
            f"| {name} | {result['tp']} | {result['cost_key_rows'] / 1e6:.0f} | "
            f"{step_ms(result['replicated']):.2f} | "
            + " / ".join("split" if s else "left" for s in goals["splits"].values())
            + " | "
            f"{goals['slowest_ms']:.2f} | {goals['balance']:.3f} / {modelled} | "
            f"{floors} | "
            f"{goals['bound_ms']:.2f} | {goals['over_bound']:.2f} | {merge} | "
            f"{ratios} | {key_split} | {_mark(goals['g1'])} | "
            f"{_mark(goals['g2'])} | {_mark(goals['g3'])} |"
        )
    lines += [
        "",
        f"G1 holds on {sum(held['g1'])} of {len(held['g1'])} steps and tps; "
        f"G2 on {sum(held['g2'])} of {len(held['g2'])} split ones; "
        f"G3 on {sum(held['g3'])} of {len(held['g3'])} tp-8 steps of "
        f"{G3_KEY_ROWS / 1e6:.0f}M key-rows or more. F1 is "
        "listed per top-k shape: "
        + ", ".join(next(iter(run["results"].values()))["floor_ms"])
        + ".",
        "",
    ]
    long_turns = [
        f"{name}: " + " / ".join(f"{1 / r:.2f}x" for r in goals["ratios"].values())
        for name in LONG_TURNS
        if f"{name} | tp 8" in run["results"]
        for goals in [step_goals(run["results"][f"{name} | tp 8"], shape, call_ms)]
        if "ratios" in goals
    ]
    if long_turns:
        lines += [
            "The long-turn steps end to end at tp 8, replicated over (slowest "
            "+ merge), NVLink / xGMI: " + "; ".join(long_turns) + ".",
            "",
        ]
    return lines


def _layouts_section(run: dict) -> list[str]:
    """The shipped planner's cost cuts and the zigzag layout on the same
    steps, judged alike (``step_goals``)."""
    shape, calls = run.get("topk_shape", "narrow"), run.get("call_ms", 0.0)
    layouts = {"cost cuts": "shipped", "zigzag": ZIGZAG}
    held: dict[str, dict[str, list[bool]]] = {
        name: {"g1": [], "g2": [], "g3": []} for name in layouts
    }
    rows = []
    for key, result in sorted(run["results"].items(), key=lambda kv: kv[1]["tp"]):
        cells = []
        for name, variant in layouts.items():
            goals = step_goals(result, shape, calls, variant)
            for goal in ("g1", "g2", "g3"):
                if goals[goal] is not None:
                    held[name][goal].append(goals[goal])
            if "slowest_ms" not in goals:
                cells.append("- | - | -")
                continue
            plan = result["split"][variant]
            cells.append(
                f"{goals['slowest_ms']:.2f} | {goals['over_bound']:.2f} | "
                + ("left" if plan is None else f"{plan.get('plan_ms', 0.0):.2f}")
            )
        name, tp = key.split(" | tp ")
        rows.append(
            f"| {name} | {tp} | {step_ms(result['replicated']):.2f} | "
            + " | ".join(cells)
            + " |"
        )
    summary = "; ".join(
        f"*{name}*: G1 {sum(h['g1'])} of {len(h['g1'])}, G2 {sum(h['g2'])} of "
        f"{len(h['g2'])}, G3 {sum(h['g3'])} of {len(h['g3'])}"
        for name, h in held.items()
    )
    # Runs that recorded the key-split rows' owners ran a zigzag planner
    # that key-splits; the ones before did not.
    zigzags = [r["split"].get(ZIGZAG) or {} for r in run["results"].values()]
    key_split = (
        "the requests whose longest row binds key-split, their rows owned in "
        "tp equal blocks"
        if any("owners" in z for z in zigzags)
        else "no key split"
    )
    return [
        "## Cost cuts and the zigzag layout side by side",
        "",
        "The same steps split by the shipped planner (contiguous ranges cut by "
        "its cost model, long rows key-split) and in the zigzag layout "
        "(`ROW_LAYOUT`: each request's rows in 2 tp blocks, rank r taking "
        f"blocks r and 2 tp - 1 - r; no cost model, {key_split}), each "
        "judged as above with its own merge and gate. *plan ms*: the "
        "planner's own host time for the step (*left*: the gate left it "
        "replicated, judged on the cost cuts forced).",
        "",
        summary + ".",
        "",
        "| step | tp | replicated ms | cost cuts: slowest ms | slowest / LB | "
        "plan ms | zigzag: slowest ms | slowest / LB | plan ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
    ]


def _variants_section(run: dict) -> list[str]:
    variants = {k: v for k, v in run["variants"].items() if k != ZIGZAG}
    lines = [
        "## Planner variants on the named steps",
        "",
        "max/mean: the ranks' GPU times; speedup: replicated GPU ms over the "
        "slowest rank's (ideal: tp). Planner variants by the costs they plan "
        "with (`ROW_COST_KEYS` and `CALL_COST_KEYS` in key-rows, "
        "`WAVE_ROWS_PER_CU` in rows per compute unit, `LOGITS_SHARE`): "
        + ", ".join(
            f"*{name}* {row:,}, {call:,}, {wave} and {share}"
            for name, (row, call, wave, share) in variants.items()
        )
        + ". A variant timed again plans the same split as the first with its "
        "costs: the difference between the two is this run's noise.",
        "",
        "| step | tp | replicated GPU ms | "
        + " | ".join(
            f"{name}: slowest rank ms / max/mean measured / modelled / speedup"
            for name in variants
        )
        + " |",
        "|---|---|---:|" + "---:|" * len(variants),
    ]
    for key, result in run["results"].items():
        name, tp = key.split(" | tp ")
        if name not in NAMED:
            continue
        rep = result["replicated"]
        cells = [
            " / ".join(
                balance(
                    result["split"][variant],
                    rep,
                    NAMED[name],
                    costs,
                    result["runs"],
                    run["calibration"]["compute_units"],
                )
            )
            for variant, costs in variants.items()
        ]
        lines.append(
            f"| {name} | {tp} | {rep['gpu_ms']:.2f} | " + " | ".join(cells) + " |"
        )
    lines += [
        "",
        '"replicated": the step stays replicated (the gate, `split_repays`, '
        "refuses it). Syncs per call, replicated and split: "
        + ", ".join(
            sorted(
                {
                    str(entry["syncs"])
                    for result in run["results"].values()
                    for entry in [result["replicated"], *result["split"].values()]
                    if entry is not None
                }
            )
        )
        + ".",
    ]
    return lines


# The links the merge is modelled on, as the stage's planner models them
# (``rocm_cp_indexer_plan.MergeLink``): NVLink from the all_gather measured on 2x
# H200, MI355X's xGMI from its link bandwidth.
LINKS = {"h200_nvlink": "NVLINK", "mi355x_xgmi": "XGMI_GFX950"}


def key_split_owners(split: dict) -> list[int]:
    """Each rank's count of the key-split rows it owns: as the run recorded
    them (a zigzag split's blocks), or, in runs before it did, the rows in
    its range."""
    from vllm.v1.attention.ops import rocm_cp_indexer_plan

    if "owners" in split:
        return split["owners"]
    planned = rocm_cp_indexer_plan.CPIndexerSplit(
        tuple(split["bounds"]), tuple(map(tuple, split.get("key_split", [])))
    )
    return planned.key_split_owners


def splits_on(result: dict, split: dict) -> dict[str, bool]:
    """Per link, whether the stage's gate (``split_repays``) splits the step
    of ``result`` with ``split``'s bounds."""
    from vllm.v1.attention.ops import rocm_cp_indexer_plan

    sizes = [b - a for a, b in pairwise(split["bounds"])]
    return {
        name: rocm_cp_indexer_plan.split_repays(
            result["cost_key_rows"],
            sizes,
            getattr(rocm_cp_indexer_plan, link),
            result.get("narrow", False),
            key_split_owners(split),
        )
        for name, link in LINKS.items()
    }
