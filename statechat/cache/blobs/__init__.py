"""Blob files of the disk tier: safetensors with metadata, checksums and atomic writes.

A blob is written to a temporary name in the same folder, fsynced, renamed into place and the
folder fsynced: a reader sees a whole blob or none. Every blob carries in its metadata the
cache format version, the model fingerprint, its token count, the block hashes it covers and a
checksum of its tensor bytes; `read_blob` checks all of them (the hashes against the index
rows' it is given), and the shapes the caller expects, before anything is used.

    encoding.py   what a blob is: file names, BlobMeta, header, checksum pieces, BlobError
    write.py      write_blob: one pass from the tensors' memory, then fsync and rename
    read.py       read_blob: verified reads in runs on a few threads, CUDA staging buffers
    residency.py  resident_fraction: how much of a file the page cache holds
"""

from __future__ import annotations

from statechat.cache.blobs.encoding import BlobError

__all__ = ["BlobError"]
