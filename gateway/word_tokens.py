"""The simulated replica's tokenizer, so precise mode can reproduce its token ids.

The simulated SGLang replica (``loadtest/simulator``) tokenizes without a vocabulary
file: it views the UTF-8 bytes of a text as little-endian 4-byte words (zero-padded to a
multiple of 4), mixes each word with a fixed 32-bit multiply-xorshift and maps it into
``VOCAB_SIZE`` ids (one token per 4 bytes, stable across processes, one numpy pass).
No Hugging Face tokenizer can produce these ids, so the ``tokenizer_config.json`` it
writes into its ``model_path`` names this scheme (``TOKENIZER_KEY: TOKENIZER_KIND``) and
the gateway's precise mode (``gateway.precise_tokens``) uses ``encode`` for it. The
function lives here, in the serving path, because the serving path never imports the
harness; the simulator imports it from here (one definition).
"""
from __future__ import annotations

import numpy as np
import numpy.typing as npt

VOCAB_SIZE = 163_840  # Kimi K2's vocabulary size
BYTES_PER_TOKEN = 4
TOKENIZER_KEY = "kvgate_token_ids"  # key in tokenizer_config.json
TOKENIZER_KIND = "word4-mix32"  # its value for this scheme
_MUL_A = np.uint32(0x9E3779B1)
_MUL_B = np.uint32(0x85EBCA77)

TokenIds = npt.NDArray[np.uint32]


def encode(text: str | bytes) -> TokenIds:
    """Token ids of a text: one id per 4 UTF-8 bytes, deterministic (dtype uint32)."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    pad = (-len(data)) % BYTES_PER_TOKEN
    if pad:
        data += b"\0" * pad
    words = np.frombuffer(data, dtype="<u4") * _MUL_A  # a new, writable uint32 array
    words ^= words >> np.uint32(15)
    words *= _MUL_B
    words ^= words >> np.uint32(13)
    # Range reduction without a division: the top 17 bits (0..131071) times 5/4 cover
    # 0..163839 = VOCAB_SIZE - 1 (VOCAB_SIZE = 5 * 2**15).
    words >>= np.uint32(15)
    words *= np.uint32(5)
    words >>= np.uint32(2)
    return words
