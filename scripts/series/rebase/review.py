# SPDX-License-Identifier: Apache-2.0
"""A rebased series under review (patches/next/<target>/): writing it,
checking that it is still made from the committed series, and adopting it
(``--accept``)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import tomllib
from dataclasses import replace
from pathlib import Path

from scripts.series import SeriesError
from scripts.series.config import GitBase, Series, Stage
from scripts.series.git import changed_files, git, git_out, is_repo
from scripts.series.layout import NEXT_DIR, RESOLUTIONS, review_dir, workdir
from scripts.series.pin_sites import PIN_FILES, moved_pin_files
from scripts.series.rebase.series_toml import (
    base_fields,
    series_toml,
    updated_series_file,
)
from scripts.series.rebase.state import (
    RebaseState,
    format_report,
    state_file,
    target_from,
    work_repo,
)
from scripts.series.stages.check import hunk_budget
from scripts.series.stages.overview import with_stage_table
from scripts.series.stages.patchfile import read_patch
from scripts.series.stages.refresh import format_stage_patch, overlay_bytes


def series_digest(series: Series) -> str:
    """A fingerprint of the committed series files, so --accept never
    overwrites edits made while the rebase was under review."""
    digest = hashlib.sha256()
    files = [series.patches_dir / "series.toml"]
    for stage in series.stages:
        files.append(series.patch_file(stage))
        files += [series.overlay_file(o) for o in stage.overlays]
    for path in files:
        digest.update(str(path.relative_to(series.root)).encode() + b"\0")
        digest.update(path.read_bytes() if path.exists() else b"<missing>")
    return digest.hexdigest()


# What the review's own bookkeeping writes, not a fix the rebase needed.
_NOT_FIXES = ("patches/", "vllm_overlay/", "build/")


def project_snapshot(series: Series) -> dict[str, str]:
    """The project's commit and each uncommitted file's blob id (empty for a
    project outside git), to tell later which files a rebase needed changed."""
    if not is_repo(series.root):
        return {}
    snapshot = {"HEAD": git_out(series.root, "rev-parse", "HEAD")}
    for path in changed_files(series.root):
        snapshot[path] = _blob_id(series.root, path)
    return snapshot


def _blob_id(root: Path, path: str) -> str:
    if not (root / path).is_file():
        return "<none>"
    return git_out(root, "hash-object", "--", path)


def project_changes(series: Series, start: dict[str, str]) -> list[str]:
    """The project's files (not the series files) that differ from what
    they were when the rebase started: fixes it needed outside vLLM."""
    if "HEAD" not in start or not is_repo(series.root):
        return []
    head = start["HEAD"]
    candidates = set(changed_files(series.root)) | set(start) - {"HEAD"}
    committed = git(series.root, "diff", "--name-only", head, check=False)
    candidates |= set(committed.stdout.decode().split())
    changed = []
    for path in sorted(candidates):
        if path.startswith(_NOT_FIXES):
            continue
        if path in start:
            was = start[path]
        else:
            blob = git(series.root, "rev-parse", f"{head}:{path}", check=False)
            was = blob.stdout.decode().strip() if blob.returncode == 0 else "<none>"
        if _blob_id(series.root, path) != was:
            changed.append(path)
    return changed


def _hunks_note(old_patch: Path, new_patch: Path, stage: Stage) -> str:
    """Every hunk of the rebased stage, the ones the rebase added (a hand
    fix, or a change the merge made) marked."""
    old_added = {
        line
        for hunk in read_patch(old_patch).hunks
        for line in hunk.text.splitlines()[1:]
        if line.startswith("+") and not line.startswith("+++")
    }
    rows = []
    for hunk in read_patch(new_patch).hunks:
        added = [
            line
            for line in hunk.text.splitlines()[1:]
            if line.startswith("+") and not line.startswith("+++")
        ]
        new_lines = [line for line in added if line not in old_added]
        mark = f"{len(new_lines)} line(s) new in the rebase" if new_lines else "-"
        size = f"+{hunk.added} -{hunk.removed}"
        rows.append(f"| {hunk.path} | `{hunk.header}` | {size} | {mark} |")
    return (
        f"Stage {stage.id} as rebased, every hunk:\n\n"
        "| file | hunk | lines | added by the rebase |\n|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n\n"
    )


def write_review(series: Series, state: RebaseState) -> Path:
    target = target_from(state.target)
    repo = work_repo(series, state)
    out = review_dir(series, target)
    shutil.rmtree(out, ignore_errors=True)
    kept = [s for s in series.stages if s.id in state.commits]
    dropped = {s.id for s in series.stages} - set(state.commits)
    kept = [replace(s, depends_on=_depends(series, s, dropped)) for s in kept]
    # The review keeps only the overlays that the rebase changed; the others
    # are read from the project's folder, which must stay as the rebase found
    # it (review_is_current).
    if state.target_commit and isinstance(target, GitBase):
        target = replace(target, rev=state.target_commit)
    regression = tuple(
        replace(suite, paths=kept_paths)
        for suite in series.regression
        if (
            kept_paths := tuple(
                p for p in suite.paths if p not in state.regression_gone
            )
        )
    )
    new = replace(
        series,
        base=target,
        stages=tuple(kept),
        regression=regression,
        patches_dir=out,
        overlay_dirs=(out / "vllm_overlay", *series.overlay_dirs),
    )
    out.mkdir(parents=True)
    changed_overlays = []
    for stage in kept:
        commit = state.commits[stage.id]
        (out / stage.patch).write_bytes(format_stage_patch(new, repo, stage, commit))
        for overlay in stage.overlays:
            data = overlay_bytes(repo, commit, overlay)
            assert data is not None
            if data != series.overlay_file(overlay).read_bytes():
                (out / "vllm_overlay" / overlay).parent.mkdir(
                    parents=True, exist_ok=True
                )
                (out / "vllm_overlay" / overlay).write_bytes(data)
                changed_overlays.append(f"`{overlay}`")
    folders = ["vllm_overlay"] + [os.path.relpath(d, out) for d in series.overlay_dirs]
    project = Path(*[".."] * len(out.relative_to(series.root).parts))
    (out / "series.toml").write_text(
        series_toml(new, out, review=(str(project), folders, state.series_digest))
    )
    rr_cache = repo / ".git" / "rr-cache"
    if rr_cache.is_dir() and any(rr_cache.iterdir()):
        shutil.copytree(rr_cache, out / RESOLUTIONS)
    overlays_note = (
        "Overlays changed by the rebase, kept in this folder's vllm_overlay/: "
        + ", ".join(changed_overlays)
        + ". The others are read from the project's vllm_overlay/.\n"
        if changed_overlays
        else "No overlay changed: all are read from the project's vllm_overlay/.\n"
    )
    gone_note = (
        "vLLM's own tests in `[[regression]]` that the target deleted, left out "
        "of this folder's series.toml (add the target's tests that cover the "
        "same code there): "
        + ", ".join(f"`{p}`" for p in state.regression_gone)
        + ".\n\n"
        if state.regression_gone
        else ""
    )
    fixes = project_changes(series, state.project_start)
    fixes_note = (
        "Project files (outside patches/ and vllm_overlay/) changed while the "
        "rebase ran, which the rebased series needs: "
        + ", ".join(f"`{p}`" for p in fixes)
        + ". Commit them with the review.\n\n"
        if fixes
        else ""
    )
    hunks_notes = "".join(
        _hunks_note(series.patch_file(stage), out / stage.patch, stage)
        for stage in kept
    )
    (out / "REBASE.md").write_text(
        f"# Rebase onto {target.label}\n\n"
        + format_report(state.reports)
        + "\n\n"
        + hunks_notes
        + gone_note
        + fixes_note
        + overlays_note
        + "\n"
        + _after_accept(load_review(out))
    )
    return out


def _after_accept(new: Series) -> str:
    """What CI's check-patches will say of the series once accepted: the
    glue budget (``accept`` refuses while it fails), the README stage
    table and the files that name the pin (``accept`` writes them)."""
    _, problems = hunk_budget(new)
    if not problems:
        return (
            "After `--accept`: the glue budget holds (CI's check-patches); the "
            "accept writes the README's stage table for this series and names "
            f"the new pin in {', '.join(PIN_FILES)}.\n"
        )
    listed = "".join(f"- {problem}\n" for problem in problems)
    return (
        "After `--accept`, CI's check-patches would fail, so the accept refuses "
        "until this folder's series.toml or patches fix it:\n\n" + listed
    )


def _depends(series: Series, stage: Stage, dropped: set[str]) -> tuple[str, ...]:
    """A stage's dependencies with upstreamed stages replaced by theirs."""
    out: list[str] = []
    for dep in stage.depends_on:
        if dep in dropped:
            out += [
                d for d in _depends(series, series.stage(dep), dropped) if d not in out
            ]
        elif dep not in out:
            out.append(dep)
    return tuple(out)


def accept(series: Series, label: str | None = None) -> None:
    """Make a reviewed rebased series (patches/next/<label>) the committed
    series and pin."""
    if state_file(series).exists():
        raise SeriesError("a rebase is in progress; finish it (--continue) first")
    reviews = sorted(
        p.parent for p in (series.patches_dir / NEXT_DIR).glob("*/series.toml")
    )
    review = _review_to_accept(series, reviews, label)
    new = load_review(review)
    if "rebased_from" not in tomllib.loads(
        (review / "series.toml").read_text(encoding="utf-8")
    ):
        raise _damaged(
            review,
            f"{review / 'series.toml'}: rebased_from: missing (the digest of "
            "the series it was rebased from)",
        )
    # Named first: after a kill, these are what differ from the review's
    # starting point.
    _refuse_unless_git_holds(
        series.root,
        [series.patches_dir / "series.toml"]
        + [series.patch_file(s) for s in series.stages]
        + [series.overlay_file(o) for s in series.stages for o in s.overlays],
    )
    if not review_is_current(series, review):
        raise SeriesError(
            "patches/ or vllm_overlay/ changed since this rebase started; refusing "
            "to overwrite them (rebase again from the current series)"
        )
    _, problems = hunk_budget(new)
    if problems:
        raise SeriesError(
            "accepting would leave a series that CI's check-patches refuses: "
            + "; ".join(problems)
            + f". Fix it in {review} (large_hunks in its series.toml, with the "
            "reason, or the patch), then accept again; nothing was written"
        )
    # Everything the accept writes is worked out before anything changes
    # (the review reads unchanged overlays from the very files about to be
    # replaced; the series file needs tomlkit).
    files = {series.patch_file(s): (review / s.patch).read_bytes() for s in new.stages}
    for stage in new.stages:
        for overlay in stage.overlays:
            files[series.overlay_file(overlay)] = new.overlay_file(overlay).read_bytes()
    series_file = series.patches_dir / "series.toml"
    text = series_file.read_text(encoding="utf-8")
    review_text = (review / "series.toml").read_text(encoding="utf-8")
    pin = base_fields(new.base, series.patches_dir)
    files[series_file] = updated_series_file(text, review_text, pin).encode()
    if (review / RESOLUTIONS).is_dir():
        for path in sorted((review / RESOLUTIONS).rglob("*")):
            if path.is_file():
                kept = (
                    series.patches_dir
                    / RESOLUTIONS
                    / path.relative_to(review / RESOLUTIONS)
                )
                files[kept] = path.read_bytes()
    # The README's stage table follows the series (check-patches compares
    # them), and the rebase's report stays as the record of what it found.
    readme = series.root / "README.md"
    if readme.is_file():
        updated = with_stage_table(readme.read_text(encoding="utf-8"), new)
        if updated is not None:
            files[readme] = updated.encode()
    # So do the files that name the pin (check-patches compares them too).
    files.update(moved_pin_files(series.root, new.base, files))
    if (review / "REBASE.md").is_file():
        kept_report = series.root / "docs" / f"rebased_onto_{new.base.label}.md"
        files[kept_report] = (review / "REBASE.md").read_bytes()
    old_files = [series.patch_file(stage) for stage in series.stages] + [
        series.overlay_file(o) for stage in series.stages for o in stage.overlays
    ]
    # Reviews of releases the new pin has reached are of no more use.
    passed = [
        other
        for other in reviews
        if other != review
        and _release(load_review(other)) is not None
        and _release(load_review(other)) <= _release(new)  # type: ignore[operator]
    ]
    deletes = [path for path in old_files if path not in files]
    _refuse_unless_git_holds(series.root, [*files, *deletes, *passed])
    # Git holds every file replaced here, so a run killed part-way is put
    # back with git (the refusal above names the files) and run again.
    for path in deletes:
        path.unlink(missing_ok=True)
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".dsa-partial")
        partial.write_bytes(data)
        os.replace(partial, path)
    for folder in (review, *passed):
        shutil.rmtree(folder, ignore_errors=True)
    next_dir = series.patches_dir / NEXT_DIR
    if next_dir.is_dir() and not any(next_dir.iterdir()):
        next_dir.rmdir()
    for other in passed:
        print(f"removed {other.relative_to(series.root)}: the new pin is past it")
    if isinstance(new.base, GitBase):
        print(
            "note: a git pin has no release, so the image tags and the "
            f"release named in {', '.join(PIN_FILES)} stay as they were "
            "(install and the Dockerfile take a release pin)"
        )
    print(
        f"the series is now on {new.base.label}; run apply to build its tree "
        f"(the old tree {workdir(series)} is left as it was); its conflict "
        f"resolutions are kept in {series.patches_dir / RESOLUTIONS}, its "
        f"report in docs/rebased_onto_{new.base.label}.md"
    )
    accepted = load_review(series.patches_dir)
    for other in sorted((series.patches_dir / NEXT_DIR).glob("*/series.toml")):
        if not review_is_current(accepted, other.parent):
            print(
                f"{other.parent} was rebased from the series before this one: "
                "rebase it again (its resolutions are replayed)"
            )


def _release(series: Series) -> tuple[int, ...] | None:
    """A release pin's version as numbers (``0.10.0`` -> (0, 10, 0)); None
    for a git checkout."""
    if isinstance(series.base, GitBase):
        return None
    return tuple(int(part) for part in re.findall(r"\d+", series.base.version))


def _review_to_accept(series: Series, reviews: list[Path], label: str | None) -> Path:
    """The review named, or else the newest release's review (a git
    checkout's must be named when there is one beside it)."""
    where = series.patches_dir / NEXT_DIR
    found = ", ".join(r.name for r in reviews) or "none"
    if label:
        named = [r for r in reviews if r.name == label]
        if not named:
            raise SeriesError(f"no rebased series {label!r} under {where} ({found})")
        return named[0]
    if len(reviews) == 1:
        return reviews[0]
    releases = [(_release(load_review(r)), r) for r in reviews]
    if not reviews or any(version is None for version, _ in releases):
        raise SeriesError(
            f"name the rebased series to accept, `nox -s rebase -- --accept "
            f"NAME` (under {where}: {found})"
        )
    return max(releases)[1]


def _refuse_unless_git_holds(root: Path, paths: list[Path]) -> None:
    """Refuse unless git holds what each of ``paths`` holds now (committed,
    or absent and untracked): accept replaces them, and then git alone can
    put them back."""
    listed = git(
        root,
        "status",
        "--porcelain=v1",
        "-z",
        "--untracked-files=all",
        "--no-renames",
        "--",
        *(str(p) for p in paths),
        check=False,
    )
    if listed.returncode != 0:
        raise SeriesError(
            f"{root} is not a git checkout: `rebase --accept` replaces files of "
            "the series and needs git to hold what they hold now; nothing was "
            "written"
        )
    changed = [e[3:] for e in listed.stdout.decode().split("\0") if e]
    if changed:
        raise SeriesError(
            "`rebase --accept` would replace files that git does not hold as "
            f"they are: {', '.join(changed)}. Commit them, or drop the changes "
            "(`git checkout -- FILE`; delete a file git does not track), then "
            "accept again; an accept killed part-way leaves such changes. "
            "Nothing was written"
        )


def review_is_current(series: Series, review: Path) -> bool:
    """Whether the rebased series in ``review`` was made from the committed
    series as it is now."""
    text = (review / "series.toml").read_text(encoding="utf-8")
    return tomllib.loads(text).get("rebased_from") == series_digest(series)


def note_if_review_is_stale(series: Series) -> None:
    """Say so if ``series`` is a rebased series under review (it has
    ``rebased_from``) made from an older version of the project's series.
    Only a note: the review still applies and tests on its own target, and
    a stage change should not turn CI red until it is rebased again."""
    project_dir = series.root / "patches"
    text = (series.patches_dir / "series.toml").read_text(encoding="utf-8")
    if series.patches_dir == project_dir or "rebased_from" not in tomllib.loads(text):
        return
    if not review_is_current(load_review(project_dir), series.patches_dir):
        print(
            f"note: {series.patches_dir} was rebased from an older version of "
            "patches/, so it does not show the latest stage changes; rebase it "
            "again with `nox -s refresh-reviews` (every review under "
            "patches/next/; the recorded conflict resolutions replay)",
            file=sys.stderr,
        )


def load_review(path: Path) -> Series:
    """The rebased series under review in ``path``; a damaged one is refused
    naming its file, what is wrong and what to run."""
    from scripts.series.config import load_series

    try:
        return load_series(path / "series.toml")
    except (SeriesError, OSError, UnicodeDecodeError) as error:
        raise _damaged(path, str(error)) from None


def _damaged(path: Path, problem: str) -> SeriesError:
    return SeriesError(
        f"{path} is not a rebased series that can be read: {problem}. Rebase "
        "again to write it anew, or delete the folder; nothing was written"
    )
