"""FNV-1a 64-bit, the hash llama.cpp's client uses to name weights for SET_TENSOR_HASH: its constants and
a plain-Python statement of it. The fast version, compiled, is kernels.hashing.fnv1a64."""

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3


def fnv1a64_reference(data: bytes) -> int:
    h = FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return h
