"""Payload codecs: what every stored payload passes through on its way to the store and back.

A codec turns bytes into bytes (`encode`) and back (`decode`), as Temporal's payload codecs
do: compression (`ZlibCodec`), encryption at rest (`AesGcmCodec`, keys by id so they can be
rotated), or both in a `CodecChain`. `connect(url, codec=...)` puts one between the engine and
its backend (`umt_sdk._codec_backend`), so the store only ever holds sealed payloads.

A sealed payload is still JSON (stores keep payloads in JSON columns): one JSON string,
``"umt-codec/1:<codec name>:<base64 of the encoded bytes>"``. Text that is not sealed is read
as it is, so a codec can be turned on for a store that already holds plaintext runs. Error
messages and tracebacks (plain text, not JSON) are sealed the same way without the quotes.

Codecs are synchronous and called once per payload: AES-GCM and zlib cost microseconds. A
codec that needs a remote key service should fetch and cache its data keys up front.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import zlib
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from attrs import define, field

from umt_sdk._check import shown
from umt_sdk.exceptions import CodecError, UsageError

__all__ = [
    "SEALED_PREFIX",
    "AesGcmCodec",
    "CodecChain",
    "PayloadCodec",
    "ZlibCodec",
    "check_codec",
    "open_json",
    "open_text",
    "seal_json",
    "seal_text",
    "sealed_by",
]

SEALED_PREFIX = "umt-codec/1:"
"""How a sealed payload begins (inside its JSON string quotes for a JSON payload)."""

_NAME = re.compile(r"^[a-z0-9][a-z0-9._+-]{0,63}$")
_KEY_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


@runtime_checkable
class PayloadCodec(Protocol):
    """Bytes in, bytes out, and back: what `connect(codec=...)` takes.

    `decode(encode(data)) == data` for every `data`. `decode` raises `CodecError` for bytes it
    cannot decode (tampered, truncated, a key it does not know), never returns garbage.
    """

    @property
    def name(self) -> str:
        """Stored with every payload (lowercase letters, digits, `._+-`): a payload sealed by
        another codec is refused with a message naming both."""
        ...

    def encode(self, data: bytes) -> bytes:
        """The stored form of `data`."""
        ...

    def decode(self, data: bytes) -> bytes:
        """`data` as it was before `encode`, or `CodecError`."""
        ...


def check_codec(codec: object, argument: str = "codec", *, where: str = "connect()") -> None:
    """Refuse what is not a `PayloadCodec` (with a usable name), naming `argument`."""
    if not isinstance(codec, PayloadCodec):
        raise UsageError(
            f"{where}: {argument} must be a payload codec (an object with name, encode(bytes) "
            "and decode(bytes), such as umt_sdk.AesGcmCodec or umt_sdk.ZlibCodec), "
            f"got {shown(codec)}",
            argument=argument,
        )
    name = codec.name
    if not isinstance(name, str) or not _NAME.match(name):
        raise UsageError(
            f"{where}: {argument}.name must be 1-64 lowercase letters, digits or '._+-' "
            f"starting with a letter or digit, got {shown(name)}",
            argument=argument,
        )


# -- sealing: the stored text of a payload --------------------------------------------------------


def seal_text(codec: PayloadCodec, text: str) -> str:
    """`text` encoded by `codec`, as stored (no quotes: for error messages and tracebacks)."""
    encoded = codec.encode(text.encode("utf-8", "surrogatepass"))
    return f"{SEALED_PREFIX}{codec.name}:{base64.b64encode(encoded).decode('ascii')}"


def seal_json(codec: PayloadCodec, text: str) -> str:
    """The JSON text `text` encoded by `codec`, as stored: one JSON string."""
    return f'"{seal_text(codec, text)}"'


def sealed_by(text: str) -> str | None:
    """The name of the codec that sealed `text` (a stored payload, JSON or plain), or None
    when it is not sealed."""
    start = 1 if text.startswith('"') else 0
    if not text.startswith(SEALED_PREFIX, start):
        return None
    name, sep, _ = text[start + len(SEALED_PREFIX) :].partition(":")
    return name if sep else None


def open_text(codec: PayloadCodec, text: str, *, what: str = "payload") -> str:
    """`text` as it was before `seal_text`; text that is not sealed is returned as it is."""
    if not text.startswith(SEALED_PREFIX):
        return text
    return _open(codec, text[len(SEALED_PREFIX) :], what)


def open_json(codec: PayloadCodec, text: str, *, what: str = "payload") -> str:
    """The JSON text `text` as it was before `seal_json`; JSON that is not sealed is returned
    as it is (a store that held plaintext before the codec was turned on)."""
    if not text.startswith('"' + SEALED_PREFIX) or not text.endswith('"'):
        return text
    return _open(codec, text[1 + len(SEALED_PREFIX) : -1], what)


def _open(codec: PayloadCodec, body: str, what: str) -> str:
    name, sep, data = body.partition(":")
    if not sep:
        raise CodecError(f"{what} is sealed but malformed (no codec name)", codec=codec.name)
    if name != codec.name:
        raise CodecError(
            f"{what} was sealed by codec {name!r}, but this engine's codec is {codec.name!r}; "
            f"connect with the codec that wrote it (or a CodecChain that reads it)",
            codec=codec.name,
        )
    try:
        raw = base64.b64decode(data.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise CodecError(f"{what} is sealed but not valid base64", codec=name) from exc
    decoded = codec.decode(raw)
    try:
        return decoded.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as exc:
        raise CodecError(f"{what} decoded by {name!r} is not UTF-8 text", codec=name) from exc


# -- the codecs umt ships -------------------------------------------------------------------------


@define(eq=False)
class ZlibCodec:
    """Compression with zlib. Payloads shorter than `min_size` bytes are stored as they are
    (compressing them would only grow them); a one-byte header says which."""

    level: int = field(default=6)
    min_size: int = field(default=256)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.level, int) or isinstance(self.level, bool):
            raise UsageError(f"ZlibCodec: level must be an int in 0..9, got {shown(self.level)}")
        if not 0 <= self.level <= 9:
            raise UsageError(f"ZlibCodec: level must be in 0..9, got {self.level}")
        if not isinstance(self.min_size, int) or self.min_size < 0:
            raise UsageError(f"ZlibCodec: min_size must be an int >= 0, got {shown(self.min_size)}")

    @property
    def name(self) -> str:
        return "zlib"

    def encode(self, data: bytes) -> bytes:
        if len(data) < self.min_size:
            return b"\x00" + data
        return b"\x01" + zlib.compress(data, self.level)

    def decode(self, data: bytes) -> bytes:
        if data[:1] == b"\x00":
            return data[1:]
        if data[:1] == b"\x01":
            try:
                return zlib.decompress(data[1:])
            except zlib.error as exc:
                raise CodecError(f"zlib: cannot decompress: {exc}", codec="zlib") from exc
        raise CodecError("zlib: unknown header (not written by ZlibCodec)", codec="zlib")


_AES_VERSION = b"\x01"
_NONCE_BYTES = 12


def _aesgcm() -> Any:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as exc:  # the extra is not installed
        raise UsageError(
            "AesGcmCodec needs the 'cryptography' package: pip install 'umt-tasks[crypto]'",
            argument="codec",
        ) from exc
    return AESGCM


@define(eq=False, repr=False)
class AesGcmCodec:
    """Encryption at rest with AES-GCM (the `cryptography` package: `umt-tasks[crypto]`).

    Keys by id: `keys={"2025-06": key_b, "2025-01": key_a}` (16, 24 or 32 random bytes each),
    `current="2025-06"`. Payloads are encrypted with the current key and carry its id;
    decryption takes the key whose id the payload names, so old keys keep reading old
    payloads: rotate by adding a key and making it current, and drop an old key only once no
    stored payload names it. A payload that was tampered with, or names a key this codec
    does not know, raises `CodecError`.

    Stored form: version byte, key id length, key id, 12-byte random nonce, ciphertext and
    tag. The version and key id are authenticated (associated data), so changing them fails
    like changing the ciphertext.
    """

    keys: Mapping[str, bytes]
    current: str
    _ciphers: dict[str, Any] = field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        aesgcm = _aesgcm()
        if not isinstance(self.keys, Mapping) or not self.keys:
            raise UsageError(
                "AesGcmCodec: keys must be a non-empty mapping of key id to key bytes, got "
                f"{shown(type(self.keys).__name__ if self.keys else self.keys)}",
                argument="keys",
            )
        for key_id, key in self.keys.items():
            if not isinstance(key_id, str) or not _KEY_ID.match(key_id):
                raise UsageError(
                    "AesGcmCodec: key ids must be 1-64 letters, digits or '._-', got "
                    f"{shown(key_id)}",
                    argument="keys",
                )
            if not isinstance(key, bytes) or len(key) not in (16, 24, 32):
                size = f"{len(key)} bytes" if isinstance(key, bytes) else shown(type(key))
                raise UsageError(
                    f"AesGcmCodec: key {key_id!r} must be 16, 24 or 32 bytes "
                    f"(os.urandom(32) makes one), got {size}",
                    argument="keys",
                )
            self._ciphers[key_id] = aesgcm(key)
        if self.current not in self._ciphers:
            raise UsageError(
                f"AesGcmCodec: current must name one of the keys ({', '.join(sorted(self.keys))})"
                f", got {shown(self.current)}",
                argument="current",
            )

    def __repr__(self) -> str:  # never the keys
        return f"AesGcmCodec(current={self.current!r}, key_ids={sorted(self.keys)!r})"

    @property
    def name(self) -> str:
        return "aes-gcm"

    def encode(self, data: bytes) -> bytes:
        key_id = self.current.encode("ascii")
        header = _AES_VERSION + bytes([len(key_id)]) + key_id
        nonce = os.urandom(_NONCE_BYTES)
        sealed: bytes = self._ciphers[self.current].encrypt(nonce, data, header)
        return header + nonce + sealed

    def decode(self, data: bytes) -> bytes:
        if data[:1] != _AES_VERSION or len(data) < 2:
            raise CodecError(
                "aes-gcm: unknown header (not written by AesGcmCodec)", codec="aes-gcm"
            )
        end = 2 + data[1]
        key_id = data[2:end].decode("ascii", "replace")
        cipher = self._ciphers.get(key_id)
        if cipher is None:
            raise CodecError(
                f"aes-gcm: the payload was encrypted with key id {key_id!r}, which this codec "
                f"does not have (it has {', '.join(sorted(self.keys))}); add that key to keys",
                codec="aes-gcm",
            )
        nonce = data[end : end + _NONCE_BYTES]
        from cryptography.exceptions import InvalidTag

        try:
            plain: bytes = cipher.decrypt(nonce, data[end + _NONCE_BYTES :], data[:end])
        except (InvalidTag, ValueError) as exc:
            raise CodecError(
                f"aes-gcm: the payload failed authentication with key {key_id!r}: it was "
                "changed after it was stored, or that key id names a different key now",
                codec="aes-gcm",
            ) from exc
        return plain


@define(eq=False, init=False)
class CodecChain:
    """Several codecs in turn: `CodecChain(ZlibCodec(), AesGcmCodec(...))` compresses, then
    encrypts (compress before you encrypt: ciphertext does not compress). Decodes in reverse."""

    codecs: tuple[PayloadCodec, ...]

    def __init__(self, *codecs: PayloadCodec) -> None:
        if not codecs:
            raise UsageError("CodecChain needs at least one codec", argument="codecs")
        for index, codec in enumerate(codecs):
            check_codec(codec, f"codecs[{index}]", where="CodecChain()")
        self.codecs = tuple(codecs)

    @property
    def name(self) -> str:
        return "+".join(codec.name for codec in self.codecs)[:64]

    def encode(self, data: bytes) -> bytes:
        for codec in self.codecs:
            data = codec.encode(data)
        return data

    def decode(self, data: bytes) -> bytes:
        for codec in reversed(self.codecs):
            data = codec.decode(data)
        return data
