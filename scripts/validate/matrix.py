# SPDX-License-Identifier: Apache-2.0
"""The validation matrix (seeds.toml, or a file of the same form) and the
commands it expands to."""

from __future__ import annotations

import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

SEEDS = Path(__file__).with_name("seeds.toml")
_PLACEHOLDER = re.compile(
    r"\{(model|port|isl|osl|conc|num_prompts|warmups|seed|result_dir|result_file)\}"
)


class MatrixError(Exception):
    """A malformed matrix file, named with the field."""


@dataclass(frozen=True)
class Point:
    isl: int
    osl: int
    conc: int
    num_prompts: int
    warmups: int | None
    seed: int | None
    # Tokens a prompt carries beyond {isl} (the fresh suffix after a shared
    # prefix of {isl} tokens); the input-token check counts them.
    suffix_len: int = 0

    @property
    def name(self) -> str:
        return f"isl{self.isl}-osl{self.osl}-c{self.conc}"


@dataclass(frozen=True)
class Variant:
    name: str
    env: dict[str, str]
    serve: tuple[str, ...]
    # The code it serves: the series installed up to this stage ("base": vLLM
    # as shipped) into the box's vLLM before its server starts; None: as is.
    install: str | None = None


@dataclass(frozen=True)
class Experiment:
    stage: str
    model: str
    port: int
    env: dict[str, str]
    serve: tuple[str, ...]
    bench: tuple[str, ...]
    points: tuple[Point, ...]
    variants: tuple[Variant, ...]
    evals: tuple[tuple[str, ...], ...]
    # The PR texts ran with prefix caching off, and the log check expects it.
    prefix_caching: bool = False

    def serve_command(self, variant: Variant) -> list[str]:
        return [self._fill(a) for a in (*self.serve, *variant.serve)]

    def serve_env(self, variant: Variant) -> dict[str, str]:
        return {**self.env, **variant.env}

    def bench_command(self, point: Point, result_dir: Path) -> list[str]:
        values = {
            "isl": point.isl,
            "osl": point.osl,
            "conc": point.conc,
            "num_prompts": point.num_prompts,
            "warmups": point.warmups,
            "seed": point.seed,
            "result_dir": result_dir,
            "result_file": f"{point.name}.json",
        }
        return [self._fill(a, values) for a in self.bench]

    def eval_commands(self, result_dir: Path) -> list[list[str]]:
        return [
            [self._fill(a, {"result_dir": result_dir}) for a in e] for e in self.evals
        ]

    def _fill(self, arg: str, values: dict | None = None) -> str:
        known = {"model": self.model, "port": self.port, **(values or {})}

        def value(match: re.Match) -> str:
            if known.get(match.group(1)) is None:
                raise MatrixError(
                    f"stage {self.stage}: {{{match.group(1)}}} has no value"
                )
            return str(known[match.group(1)])

        return _PLACEHOLDER.sub(value, arg)


def _per_concurrency(raw: object, conc: int, where: str) -> int:
    """``{ per_c = a, min = b }``: max(a * C, b) at concurrency C."""
    if not isinstance(raw, dict) or set(raw) - {"per_c", "min"}:
        raise MatrixError(f"{where}: expected {{ per_c = N, min = M }}, got {raw!r}")
    per_c, least = raw.get("per_c", 0), raw.get("min", 0)
    if not (isinstance(per_c, int) and isinstance(least, int)) or per_c < 0:
        raise MatrixError(f"{where}: per_c and min must be integers, got {raw!r}")
    return max(per_c * conc, least)


def _strings(raw: object, where: str) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(isinstance(a, str) for a in raw):
        raise MatrixError(f"{where}: expected a list of strings")
    return tuple(raw)


def _stage(raw: object, where: str) -> str | None:
    if raw is None or (isinstance(raw, str) and re.fullmatch(r"base|\d{4}", raw)):
        return raw
    raise MatrixError(f"{where}: install must be 'base' or a stage id, got {raw!r}")


def _env(raw: object, where: str) -> dict[str, str]:
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw.items()
    ):
        raise MatrixError(f"{where}: expected a table of strings")
    return dict(raw)


def load_experiment(stage: str, path: Path = SEEDS) -> Experiment:
    """Stage ``stage``'s experiment from the matrix file at ``path``."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise MatrixError(f"{path}: {exc}") from None
    key = f"stage_{stage}"
    if key not in raw:
        known = ", ".join(k.removeprefix("stage_") for k in raw) or "none"
        raise MatrixError(f"{path}: no [{key}] (stages: {known})")
    table = raw[key]
    where = f"{path}: {key}"
    points = []
    for index, p in enumerate(table.get("points", [])):
        here = f"{where}.points[{index}]"
        for conc in p["concurrency"]:
            points.append(
                Point(
                    isl=int(p["isl"]),
                    osl=int(p["osl"]),
                    conc=int(conc),
                    num_prompts=_per_concurrency(p["num_prompts"], conc, here),
                    warmups=(
                        _per_concurrency(p["warmups"], conc, here)
                        if "warmups" in p
                        else None
                    ),
                    seed=int(p["seed"]) if "seed" in p else None,
                    suffix_len=int(p.get("suffix_len", 0)),
                )
            )
    variants = tuple(
        Variant(
            v["name"],
            _env(v.get("env", {}), f"{where}.variants"),
            _strings(v.get("serve", []), f"{where}.variants"),
            _stage(v.get("install"), f"{where}.variants"),
        )
        for v in table.get("variants", [])
    )
    if not points or not variants:
        raise MatrixError(f"{where}: needs points and variants")
    return Experiment(
        stage=stage,
        model=str(table["model"]),
        port=int(table["port"]),
        env=_env(table.get("env", {}), f"{where}.env"),
        serve=_strings(table["serve"], f"{where}.serve"),
        bench=_strings(table["bench"], f"{where}.bench"),
        points=tuple(points),
        variants=variants,
        evals=tuple(_strings(e, f"{where}.evals") for e in table.get("evals", [])),
        prefix_caching=bool(table.get("prefix_caching", False)),
    )


def shell_line(command: list[str], env: dict[str, str] | None = None) -> str:
    """A command as one shell line (what --dry-run prints)."""
    prefix = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    return " ".join(prefix + [shlex.quote(a) for a in command])
