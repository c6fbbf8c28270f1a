"""Which files a source reads. A source path is a file, a folder (searched recursively for the
format's files, or for `glob` when set) or a glob pattern (`/data/web/2024-*/part-*.jsonl`,
`**` crosses folders). Only matching files are read, so a text source pointed at a mixed folder
does not read its PNG files as text.

Listing fails loudly: a path that does not exist or cannot be read (a file, or a folder anywhere
below the path, without read permission) is a ConfigError naming it instead of being read as
zero files. A folder with no matching file is zero records (the run says so in its summary).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from model.errors import ConfigError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
VIDEO_EXTENSIONS = (".gif", ".webp", ".apng")


def _any_of(extensions: tuple[str, ...]) -> str:
    return "**/*.{" + ",".join(e[1:] for e in extensions) + "}"


# what a folder source reads by default, per format (relative to the folder)
DEFAULT_GLOBS = {
    "jsonl": "**/*.jsonl",
    "parquet": "**/*.parquet",
    "webdataset": "**/*.tar",
    "image_folder": _any_of(IMAGE_EXTENSIONS),
    "image_text": "**/*.jsonl",
    "frame_folder": "**/caption.txt",
    "video_files": _any_of(VIDEO_EXTENSIONS),
}
_MAGIC = re.compile(r"[*?\[{]")


def glob_regex(pattern: str) -> re.Pattern:
    """A glob over '/'-separated relative paths: `*` and `?` stay inside one path part, `**/`
    spans any number of folders, `{a,b}` is either, `[...]` a character class. Case is
    ignored (`*.png` matches `A.PNG`)."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "{":
            end = pattern.index("}", i)
            out.append("(?:" + "|".join(map(re.escape, pattern[i + 1:end].split(","))) + ")")
            i = end
        elif c == "[":
            end = pattern.index("]", i + 1)
            out.append("[" + pattern[i + 1:end].replace("!", "^", 1) + "]")
            i = end
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out), re.IGNORECASE)


def _fail(field: str, path: str, why: str) -> None:
    raise ConfigError(f"{field}={path!r} is invalid: {why}")


def _walk(root: str, field: str, shown: str) -> list[str]:
    """Every file below `root`, relative to it; an unreadable folder is an error naming it."""
    def unreadable(e: OSError) -> None:
        _fail(field, shown, f"cannot read {e.filename}: {e.strerror}")

    files = []
    for folder, _, names in os.walk(root, onerror=unreadable, followlinks=True):
        rel = os.path.relpath(folder, root)
        files += [n if rel == "." else f"{rel}/{n}" for n in names]
    return files


def list_source_files(path: str, fmt: str, glob: str | None, field: str) -> tuple[str, list[str]]:
    """(base folder, sorted file paths relative to it) of a source; `path` already resolved,
    `field` the config path named in errors (e.g. data.sources[0].path)."""
    if _MAGIC.search(path):
        parts = Path(path).parts
        fixed = next(i for i, p in enumerate(parts) if _MAGIC.search(p))
        base, pattern = str(Path(*parts[:fixed])), "/".join(parts[fixed:])
        if not os.path.isdir(base):
            _fail(field, path, f"the folder {base} does not exist")
    elif os.path.isfile(path):
        if not os.access(path, os.R_OK):
            _fail(field, path, "the file cannot be read (permission denied)")
        return os.path.dirname(os.path.abspath(path)), [os.path.basename(path)]
    elif os.path.isdir(path):
        base, pattern = path, glob or DEFAULT_GLOBS[fmt]
    else:
        _fail(field, path, "no such file or folder")
    match = glob_regex(pattern)
    files = sorted(f for f in _walk(base, field, path) if match.fullmatch(f))
    for f in files:
        if not os.access(os.path.join(base, f), os.R_OK):
            _fail(field, path, f"cannot read {os.path.join(base, f)}: permission denied")
    return base, files
