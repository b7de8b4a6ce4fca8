"""The codec of the CLI codec tests: `umt --codec tests.integration.cli.codec_app:make_codec`."""

from __future__ import annotations

from umt_sdk import AesGcmCodec, CodecChain, PayloadCodec, ZlibCodec

KEY = bytes(range(7, 39))


def make_codec() -> PayloadCodec:
    """What a service's codec factory does: read the keys (here a constant), build the codec."""
    return CodecChain(ZlibCodec(), AesGcmCodec(keys={"k1": KEY}, current="k1"))


not_a_codec = "aes"
