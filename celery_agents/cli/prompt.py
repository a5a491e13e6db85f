"""Building the user's query from `-p TEXT`, `--file PATH` and `--media PATH`, in the order given."""

from __future__ import annotations

import base64
import json
import mimetypes
import re
import sys
from pathlib import Path
from typing import Any

from celery_agents.client import check_token_shape as check_token_shape  # the commands' import
from celery_agents.errors import InvalidInput, InvalidResult
from celery_agents.model import Media, UserQuery

_FLAGS = {"-p": "prompt", "--prompt": "prompt", "--file": "file", "-f": "file", "--media": "media", "-m": "media"}


def ordered_parts(argv: list[str], prompts: list[str], files: list[str], media: list[str]) -> list[tuple[str, str]]:
    """The prompt parts in command-line order (typer hands each option's values over separately)."""
    found: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            break
        kind = _FLAGS.get(arg.split("=", 1)[0]) if arg.startswith("-") else None
        if kind and "=" in arg and arg.startswith("--"):
            found.append((kind, arg.split("=", 1)[1]))
        elif kind and i + 1 < len(argv):
            found.append((kind, argv[i + 1]))
            i += 1
        i += 1
    expected = [("prompt", p) for p in prompts] + [("file", f) for f in files] + [("media", m) for m in media]
    if sorted(found) == sorted(expected):
        return found
    return expected


def build_query(parts: list[tuple[str, str]], media_max_bytes: int) -> UserQuery:
    """The query from the parts in order; an attachment may hold `media_max_bytes` at most."""
    texts: list[str] = []
    attachments: list[Media] = []
    for kind, value in parts:
        if kind == "prompt":
            texts.append(value)
        elif kind == "file":
            texts.append(_read_text(value))
        else:
            attachments.append(read_media(value, media_max_bytes))
    kept = [t for t in texts if t.strip()]
    # One blank line between parts: a file's (or stdin's) own last line break does not add another.
    text = kept[0] if len(kept) == 1 else "\n\n".join(t.rstrip("\r\n") for t in kept)
    if not text.strip() and not attachments:
        raise InvalidInput("give a prompt: -p TEXT, --file PATH or --media PATH (each may repeat)")
    return UserQuery(text=text, media=attachments)


def _read_text(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InvalidInput(f"--file {path}: no such file") from None
    except UnicodeDecodeError:
        raise InvalidInput(f"--file {path}: not UTF-8 text (attach binary files with --media)") from None
    except OSError as exc:
        raise InvalidInput(f"--file {path}: cannot read it: {exc}") from None


def read_media(path: str, max_bytes: int) -> Media:
    p = Path(path)
    try:
        size = p.stat().st_size
    except FileNotFoundError:
        raise InvalidInput(f"--media {path}: no such file") from None
    if size > max_bytes:
        raise InvalidInput(
            f"--media {path}: {size} bytes is more than the limit of {max_bytes} (AGENTS_MEDIA_MAX_BYTES)"
        )
    if size == 0:
        raise InvalidInput(f"--media {path}: the file is empty")
    mime, _ = mimetypes.guess_type(p.name)
    return Media(
        mime_type=mime or "application/octet-stream",
        data_base64=base64.b64encode(p.read_bytes()).decode(),
        filename=p.name,
    )


def read_result(source: str) -> str:
    """The text of a result file, or of stdin for `-`; an empty result is refused."""
    if source == "-":
        raw = sys.stdin.read()
    else:
        try:
            raw = Path(source).read_text(encoding="utf-8")
        except FileNotFoundError:
            if source.lstrip().startswith(("{", "[", '"')):
                raise InvalidResult(
                    f"{source[:80]}: no such result file — to give JSON inline, pipe it: "
                    f"echo '{source[:40]}' | agents session complete TOKEN -"
                ) from None
            raise InvalidResult(f"{source}: no such result file (give a file holding JSON or text, or -)") from None
        except IsADirectoryError:
            raise InvalidResult(f"{source}: is a folder, not a result file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidResult(f"{source}: cannot read it as text: {exc}") from None
    if not raw.strip():
        raise InvalidResult(f"{'stdin' if source == '-' else source}: the result is empty; give JSON or text")
    return raw


def read_arguments(source: str) -> dict[str, Any]:
    """Edited arguments for `approve --arguments`: a JSON object in a file, or on stdin for `-`."""
    from celery_agents.errors import InvalidArguments
    from celery_agents.model.limits import UnusableJson, load_json

    where = "stdin" if source == "-" else source
    try:
        raw = read_result(source)
    except InvalidResult as exc:
        text = exc.message.replace("JSON or text, or -)", "a JSON object, or -)")
        raise InvalidArguments(text.replace("result", "arguments")) from None
    try:
        value = load_json(raw)
    except (json.JSONDecodeError, UnusableJson) as exc:
        raise InvalidArguments(f"{where}: the arguments are not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArguments(f"{where}: the arguments must be a JSON object ({{...}})")
    return value


def parse_result(raw: str, max_bytes: int, source: str = "-") -> object:
    """JSON text is the result as that JSON value; any other text is the result as stripped text
    (what refuses a result is `runtime.completions`, for the CLI and the stream alike). Text that
    starts like a JSON object or list but does not parse is refused (a typo would otherwise reach
    the model as a string): `--text` records it as text."""
    import json

    from celery_agents.runtime.completions import parse_result_text

    value = parse_result_text(raw, max_bytes)
    if isinstance(value, str) and value.startswith(("{", "[")):
        try:
            json.loads(value)
        except json.JSONDecodeError as exc:
            where = "stdin" if source == "-" else source
            raise InvalidResult(
                f"{where}: line {exc.lineno} column {exc.colno}: not valid JSON: {exc.msg} "
                "(fix it, or pass --text to record it as text)"
            ) from None
    return value


_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    """`30d`, `12h`, `45m`, `90s`, `2w` in seconds."""
    m = _AGE.match(text)
    if not m:
        raise InvalidInput(f"--older-than {text!r}: give a number and a unit, e.g. 30d, 12h, 45m or 90s")
    return float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
