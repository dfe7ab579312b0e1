# SPDX-License-Identifier: Apache-2.0
"""The host bench's calibration (``--variants``): the logits and top-k
timed on uniform chunks and fitted for the planner's row, call and wave
costs; and ``--topk-shapes``, the top-k stand-in's shapes timed side by
side."""

from __future__ import annotations

from scripts.bench import cp_indexer_host_timing as timing

K = timing.K

# The calibration's chunks: R rows of L keys each (R * L <= 2**28 fp32
# logits), and chunks of fewer rows than a few waves, for the wave's size.
CALIBRATION_ROWS = (256, 1024, 4096)
CALIBRATION_KEYS = (4096, 16384, 65536, 200 * K)
WAVE_KEYS = (65536, 200 * K)
WAVE_SAMPLES_PER_CU = (0.25, 0.5, 1, 1.5, 2, 3)
# The waves tried in the logits' fit, in rows per compute unit.
WAVES_PER_CU = (0.5, 1, 1.25, 1.5, 1.75, 2, 2.5, 3)


def fit_costs(samples: list[dict], wave: int) -> dict:
    """``ms = a * max(rows, wave) * keys + b * rows + c`` fitted by least
    squares to each kernel's times and their sum (``wave`` 0: a R L)."""
    import torch

    design = torch.tensor(
        [[max(s["rows"], wave) * s["keys"], s["rows"], 1.0] for s in samples],
        dtype=torch.float64,
    )
    fit: dict = {"wave_rows": wave}
    for part in ("logits_ms", "topk_ms", "total"):
        times = torch.tensor(
            [
                s["logits_ms"] + s["topk_ms"] if part == "total" else s[part]
                for s in samples
            ],
            dtype=torch.float64,
        )
        a, b, c = torch.linalg.lstsq(design, times[:, None]).solution[:, 0].tolist()
        modelled = design @ torch.tensor([a, b, c], dtype=torch.float64)
        fit[part] = {
            "ns_per_key_row": a * 1e6,
            "ns_per_row": b * 1e6,
            "us_per_call": c * 1e3,
            "worst_relative_error": float(((modelled - times).abs() / times).max()),
        }
    fit["row_cost_keys"] = round(
        fit["total"]["ns_per_row"] / fit["total"]["ns_per_key_row"]
    )
    fit["call_cost_keys"] = round(
        fit["total"]["us_per_call"] * 1e3 / fit["total"]["ns_per_key_row"]
    )
    return fit


def calibrate(runs: int) -> dict:
    """The logits + top-k time (``chunk_kernels``) on uniform chunks. ``fit``: the
    whole op on the chunks of CALIBRATION_ROWS, ``ms = a R L + b R + c``
    (``row_cost_keys`` = b / a, ``call_cost_keys`` = c / a). ``wave``: the
    logits alone, fitted with the wave W (in rows per compute unit, from
    ``WAVES_PER_CU``) whose fit errs least, and the logits' share of a
    key-row's cost, ``logits_share``."""
    units = timing.compute_units()
    shapes = [
        (rows, keys)
        for rows in CALIBRATION_ROWS
        for keys in CALIBRATION_KEYS
        if rows * keys <= 1 << 28
    ]
    shapes += [
        (max(1, round(units * waves)), keys)
        for waves in WAVE_SAMPLES_PER_CU
        for keys in WAVE_KEYS
    ]
    samples = []
    for rows, keys in shapes:
        samples.append(timing.time_chunk(rows, keys, runs))
        print("calibration", samples[-1], flush=True)
    # The row and call costs from the chunks of a few waves and more, where
    # the floor does not hold: fitted with the wave's chunks they would be
    # bent by it.
    fit = fit_costs([s for s in samples if s["rows"] in CALIBRATION_ROWS], 0)
    waves = [
        fit_costs(samples, round(units * per_cu)) | {"wave_rows_per_cu": per_cu}
        for per_cu in WAVES_PER_CU
    ]
    wave = min(waves, key=lambda f: f["logits_ms"]["worst_relative_error"])
    wave["logits_share"] = round(
        wave["logits_ms"]["ns_per_key_row"] / fit["total"]["ns_per_key_row"], 2
    )
    return {
        "samples": samples,
        "compute_units": units,
        "fit": fit,
        "waves": waves,
        "wave": wave,
    }


# --topk-shapes: one call of R rows of L keys each, per top-k stand-in shape:
# a long row alone and in twos (AITER's multi-block top-k), a rank's sliver
# of a long turn, and full calls.
SHAPE_CHUNKS = ((1, 200 * K), (2, 100 * K), (128, 100 * K), (2048, 16 * K))


def topk_shapes(runs: int) -> list[dict]:
    """Logits and top-k GPU ms (``time_chunk``) on SHAPE_CHUNKS with each
    top-k shape: which one the bench's runs should take on this GPU."""
    from scripts.harness import fast_indexer_kernels as fast

    results = []
    for rows, keys in SHAPE_CHUNKS:
        for shape in fast.TOPK_SHAPES:
            fast.TOPK_SHAPE = shape
            results.append({"shape": shape, **timing.time_chunk(rows, keys, runs)})
            print(results[-1], flush=True)
    return results
