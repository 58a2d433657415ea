"""A checkpoint's weights fingerprint: which model this is, cheaply, whatever its sharding or folder.

sha256 over every tensor, in name order, of its name, dtype, shape and the first and last 4 KiB of its data
(8 KiB a tensor: a few MB for a 70B model, read through the shards' mappings). Quantize records the source's in
quantkit_meta.json (`source_fingerprint`); `quantkit eval` recomputes it from --base to tell whether the
quantized checkpoint was made from that base. Two checkpoints with the same tensors have the same fingerprint;
another model (another fine-tune, other weights of the same shape) has another one, as do the same weights
saved in another dtype.
"""

from __future__ import annotations

import hashlib

from quantkit.model.checkpoint import ShardReader

SAMPLE_BYTES = 4096


def weights_fingerprint(reader: ShardReader) -> str:
    """Over the tensors as stored: a reader that presents them otherwise (MXFP4 read dequantized, stacked experts
    read one at a time) hashes the stored ones."""
    digest = hashlib.sha256()
    for key in sorted(reader.entries):
        entry = reader.entries[key]
        digest.update(f"{key}\0{entry.dtype}\0{list(entry.shape)}\0".encode())
        digest.update(reader.sample_bytes(key, SAMPLE_BYTES))
    return digest.hexdigest()[:16]
