"""The request side of ``recstack serve``: read a body (bounded in size and time), decode and
type-check it with msgspec, name the field at fault when it is wrong, and encode answers.

Every way a body can be wrong ends here as a :class:`BadRequest` (a 4xx and ``{"error", "field"}``),
never as a 5xx: malformed JSON, nesting deep enough to exhaust the decoder's recursion, integers of
thousands of digits, values of the wrong type, unknown keys. The checks that depend on the model
(feature names, value types and ranges) are the encoder's (``ServingModel.encode``,
``RequestError``); ``error_field`` maps them into the request's shape.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
from starlette.requests import Request

from recstack.serving.artifact import RequestError

Rows = list[dict[str, Any]]


class BadRequest(Exception):
    """A request the server refuses: HTTP ``status`` with ``{"error": message, "field": field}``."""

    def __init__(self, status: int, field: str | None, message: str) -> None:
        super().__init__(message)
        self.status, self.field = status, field


class ScoreRequest(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /v1/score``: rows, or shared features and candidates (see docs/serving.md)."""

    rows: Rows | None = None
    shared: dict[str, Any] | None = None
    candidates: Rows | None = None
    return_logit: bool = False
    encoded: bool = False


@dataclass
class Parsed:
    """A request's parts: form ("rows" or "candidates"), the shared features (candidates form), the
    rows (or candidates), whether to return logits, whether the rows carry encoded ids instead of
    raw values."""

    form: str
    shared: dict | None
    rows: Rows
    return_logit: bool
    encoded: bool


_SCORE = msgspec.json.Decoder(ScoreRequest)
_ROW = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ANY = msgspec.json.Decoder()
_ENCODE = msgspec.json.Encoder()
_PATH = re.compile(r" - at `\$(.*)`$")


def _where(raw: bytes, path: str) -> str | None:
    """A msgspec error path (``.rows[3][...]``) -> the field it means (``rows[3].C7``). msgspec does
    not name the key of a dict value, so the object at fault is decoded again key by key (on the
    error path only)."""
    path = path.lstrip(".")
    if not path.endswith("[...]"):
        return path or None
    prefix = path[: -len("[...]")]
    m = re.fullmatch(r"(rows|candidates)\[(\d+)\]|shared", prefix)
    if m is None:
        return prefix
    try:
        top = msgspec.json.decode(raw, type=dict[str, msgspec.Raw])
        obj = top[m.group(1)] if m.group(1) else top["shared"]
        if m.group(1):
            obj = msgspec.json.decode(obj, type=list[msgspec.Raw])[int(m.group(2))]
        for key, value in _ROW.decode(obj).items():
            try:
                _ANY.decode(value)
            except (msgspec.DecodeError, RecursionError):
                return f"{prefix}.{key}"
    except (msgspec.DecodeError, RecursionError, KeyError, IndexError):
        pass
    return prefix


def decode(raw: bytes, decoder: msgspec.json.Decoder) -> Any:
    """A body -> its typed value (``decoder.type``); BadRequest (400) naming the field on any
    decoding or type error. Python's ``json`` writes NaN and Infinity as bare words, which JSON does
    not have: such a body is read by ``json`` instead, so that the encoder names the field that
    holds one."""
    try:
        try:
            return decoder.decode(raw)
        except msgspec.DecodeError as e:
            if isinstance(e, msgspec.ValidationError):
                raise
            try:
                value = json.loads(raw)
            except (ValueError, RecursionError):
                raise BadRequest(400, "body", f"malformed JSON: {e}") from None
            return msgspec.convert(value, decoder.type)
    except RecursionError:
        raise BadRequest(400, "body", "JSON nested too deeply") from None
    except msgspec.ValidationError as e:
        text = str(e)
        m = _PATH.search(text)
        field = _where(raw, m.group(1)) if m else None
        unknown = re.search(r"unknown field `(.*)`", text)
        if unknown:
            field = unknown.group(1)
        message = text[: m.start()] if m else text
        raise BadRequest(400, field or "body", f"{field or 'body'}: {message}") from None


def parse_request(body: bytes, max_rows: int) -> Parsed:
    """A ``/v1/score`` body -> its parts, checked as far as they do not depend on the model (the
    features are the model encoder's to check). Raises BadRequest naming the field."""
    req: ScoreRequest = decode(body, _SCORE)
    if req.rows is not None:
        if req.shared is not None or req.candidates is not None:
            raise BadRequest(400, "rows", "give either rows, or shared and candidates, not both")
        form, shared, rows = "rows", None, req.rows
    elif req.candidates is not None:
        form, shared, rows = "candidates", req.shared or {}, req.candidates
    else:
        raise BadRequest(400, "rows", "missing field 'rows' (or 'candidates' with 'shared')")
    if not rows:
        raise BadRequest(400, form, f"{form}: expected a non-empty list of objects")
    if len(rows) > max_rows:
        raise BadRequest(
            400, form, f"{form}: {len(rows)} rows, more than the limit of {max_rows} (--max-rows)"
        )
    return Parsed(form, shared, rows, req.return_logit, req.encoded)


def error_field(e: RequestError, form: str, shared: dict | None) -> str:
    """Where a RequestError of the model's encoder points in the request: ``rows[3].C7``,
    ``shared.I1``..."""
    if shared is not None and e.field is not None and e.field in shared:
        return f"shared.{e.field}"
    if e.row is None:
        return e.field or form
    return f"{form}[{e.row}]" + (f".{e.field}" if e.field is not None else "")


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, refusing (413) one over ``limit`` bytes before reading it when its length is
    declared, else as soon as it grows past the limit; 408 when it has not fully arrived within
    ``timeout_s`` (a stalled client holds no request, and no shutdown, longer than that)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(
            413, "body", f"body of {declared} bytes is over the limit of {limit} (--max-body-bytes)"
        )
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise BadRequest(
                        413, "body", f"body over the limit of {limit} bytes (--max-body-bytes)"
                    )
                chunks.append(chunk)
    except TimeoutError:
        raise BadRequest(
            408, "body", f"the body did not arrive within {timeout_s:g} s (--body-timeout)"
        ) from None
    return b"".join(chunks)


def check_finite(logits: np.ndarray, form: str) -> None:
    """Non-finite scores never leave the server: finite inputs that drive the model out of float32's
    range (values far outside the trained ones) are the request's fault (422), named by row."""
    bad = np.flatnonzero(~np.isfinite(logits))
    if len(bad):
        raise BadRequest(
            422,
            f"{form}[{bad[0]}]",
            f"{form}[{bad[0]}]: the model's score is not finite for "
            "this row (values far outside the range the model was trained on)",
        )


def encode_json(doc: Any) -> bytes:
    """An answer -> JSON bytes (msgspec; floats are finite here: the server refuses non-finite
    scores)."""
    return _ENCODE.encode(doc)
