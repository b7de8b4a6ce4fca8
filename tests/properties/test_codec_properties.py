"""Properties of payload codecs: every JSON value comes back whole through each codec, a sealed
payload changed anywhere is refused with `CodecError` (never decoded to something else), and a
rotated key reads what the old one wrote."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.strategies import json_values, storable_text
from umt_sdk import AesGcmCodec, CodecChain, CodecError, PayloadCodec, UsageError, ZlibCodec
from umt_sdk._codec import open_json, open_text, seal_json, seal_text, sealed_by
from umt_sdk._codec_backend import open_payloads, seal_payloads
from umt_sdk._spi import ErrorInfo, StepRecord

KEY_A = bytes(range(32))
KEY_B = bytes(range(100, 132))
KEY_C = bytes(range(16))

CODECS: dict[str, PayloadCodec] = {
    "zlib": ZlibCodec(min_size=0),
    "zlib-small-raw": ZlibCodec(),
    "aes-gcm": AesGcmCodec(keys={"a": KEY_A}, current="a"),
    "chain": CodecChain(ZlibCodec(min_size=0), AesGcmCodec(keys={"a": KEY_A}, current="a")),
}
codecs = st.sampled_from(sorted(CODECS)).map(CODECS.__getitem__)


@given(codec=codecs, value=json_values)
def test_every_json_value_round_trips(codec: PayloadCodec, value: Any) -> None:
    text = json.dumps(value, ensure_ascii=False)
    sealed = seal_json(codec, text)
    assert json.loads(sealed).startswith("umt-codec/1:"), "still JSON: one string"
    assert sealed_by(sealed) == codec.name
    assert open_json(codec, sealed) == text
    assert json.loads(open_json(codec, sealed)) == value


@given(codec=codecs, text=storable_text)
def test_plain_text_round_trips(codec: PayloadCodec, text: str) -> None:
    assert open_text(codec, seal_text(codec, text)) == text


@given(codec=codecs, value=json_values)
def test_text_that_is_not_sealed_reads_as_it_is(codec: PayloadCodec, value: Any) -> None:
    text = json.dumps(value)
    assert sealed_by(text) is None or text.startswith('"umt-codec/1:')
    if sealed_by(text) is None:
        assert open_json(codec, text) == text


_AEAD = {name: CODECS[name] for name in ("aes-gcm", "chain")}


@given(
    name=st.sampled_from(sorted(_AEAD)),
    value=json_values,
    where=st.integers(min_value=0),
    flip=st.integers(min_value=1, max_value=255),
)
def test_a_changed_byte_is_refused(name: str, value: Any, where: int, flip: int) -> None:
    codec = _AEAD[name]
    sealed = seal_json(codec, json.dumps(value))
    prefix, _, body = sealed.strip('"').rpartition(":")
    data = bytearray(base64.b64decode(body))
    data[where % len(data)] ^= flip
    tampered = f'"{prefix}:{base64.b64encode(bytes(data)).decode()}"'
    with pytest.raises(CodecError) as caught:
        open_json(codec, tampered)
    assert "aes-gcm" in str(caught.value)


@given(value=json_values, cut=st.integers(min_value=1, max_value=40))
def test_a_truncated_payload_is_refused(value: Any, cut: int) -> None:
    codec = CODECS["aes-gcm"]
    sealed = seal_json(codec, json.dumps(value))
    prefix, _, body = sealed.strip('"').rpartition(":")
    data = base64.b64decode(body)
    short = data[: max(0, len(data) - cut)]
    with pytest.raises(CodecError):
        open_json(codec, f'"{prefix}:{base64.b64encode(short).decode()}"')


@given(old=st.lists(json_values, max_size=4), new=st.lists(json_values, max_size=4))
def test_key_rotation(old: list[Any], new: list[Any]) -> None:
    before = AesGcmCodec(keys={"2025-01": KEY_A}, current="2025-01")
    rotated = AesGcmCodec(keys={"2025-01": KEY_A, "2025-06": KEY_B}, current="2025-06")
    only_new = AesGcmCodec(keys={"2025-06": KEY_B}, current="2025-06")
    sealed_old = [seal_json(before, json.dumps(v)) for v in old]
    sealed_new = [seal_json(rotated, json.dumps(v)) for v in new]
    # Decrypt with any known key id, encrypt with the current one.
    assert [json.loads(open_json(rotated, s)) for s in sealed_old] == old
    assert [json.loads(open_json(rotated, s)) for s in sealed_new] == new
    assert [json.loads(open_json(only_new, s)) for s in sealed_new] == new
    for sealed in sealed_old:
        with pytest.raises(CodecError, match="key id '2025-01'"):
            open_json(only_new, sealed)
    for sealed in sealed_new:
        with pytest.raises(CodecError, match="key id '2025-06'"):
            open_json(before, sealed)


def test_a_key_id_that_names_another_key_is_refused() -> None:
    writer = AesGcmCodec(keys={"k": KEY_A}, current="k")
    reader = AesGcmCodec(keys={"k": KEY_B}, current="k")
    with pytest.raises(CodecError, match="failed authentication with key 'k'"):
        open_json(reader, seal_json(writer, '{"a": 1}'))


def test_another_codec_is_named() -> None:
    sealed = seal_json(CODECS["zlib"], "[1]")
    with pytest.raises(CodecError, match=r"sealed by codec 'zlib'.*codec is 'aes-gcm'"):
        open_json(CODECS["aes-gcm"], sealed)


@given(codec=codecs, output=json_values, message=storable_text, trace=storable_text)
def test_records_seal_every_payload_and_nothing_else(
    codec: PayloadCodec, output: Any, message: str, trace: str
) -> None:
    record = StepRecord(
        name="charge",
        kind="step",
        status="failed",
        output_json=json.dumps(output),
        error=ErrorInfo(type="builtins.ValueError", message=message, traceback=trace),
    )
    sealed = seal_payloads(codec, record)
    assert sealed.name == "charge"
    assert sealed.error is not None
    assert sealed.error.type == "builtins.ValueError"
    assert sealed.output_json is not None
    assert sealed_by(sealed.output_json) == codec.name
    assert message == "" or sealed_by(sealed.error.message) == codec.name
    assert open_payloads(codec, sealed) == record
    assert open_payloads(codec, [sealed, (sealed,)]) == [record, (record,)]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: AesGcmCodec(keys={}, current="a"), "non-empty mapping"),
        (lambda: AesGcmCodec(keys={"a": b"short"}, current="a"), "16, 24 or 32 bytes"),
        (lambda: AesGcmCodec(keys={"a": "text" * 8}, current="a"), "16, 24 or 32 bytes"),
        (lambda: AesGcmCodec(keys={"a b": KEY_A}, current="a b"), "key ids must be"),
        (lambda: AesGcmCodec(keys={"a": KEY_A}, current="b"), "current must name one of"),
        (lambda: ZlibCodec(level=11), "level must be in 0..9"),
        (lambda: ZlibCodec(min_size=-1), "min_size"),
        (lambda: CodecChain(), "at least one codec"),
        (lambda: CodecChain(object()), "codecs\\[0\\] must be a payload codec"),
    ],
)
def test_bad_arguments_are_named(make: Any, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        make()


def test_keys_never_show() -> None:
    codec = AesGcmCodec(keys={"a": KEY_A, "b": KEY_C}, current="a")
    assert repr(KEY_A) not in repr(codec)
    assert repr(codec) == "AesGcmCodec(current='a', key_ids=['a', 'b'])"


async def test_connect_refuses_what_is_not_a_codec() -> None:
    from umt_sdk import connect

    with pytest.raises(UsageError, match="codec must be a payload codec"):
        await connect("memory://", codec="aes")
