"""A blob reads back exactly what was written (any dtype, empty tensors, sizes that are not a
multiple of the read piece), on the CPU and, where there is one, on a CUDA device; a flipped
byte in any piece, a truncated file and a header that does not match are each refused with
one clear line, before any tensor is handed out."""

from __future__ import annotations

import json
import zlib

import pytest
import torch

from statechat.cache.blobs import encoding, residency
from statechat.cache.blobs import read as blob_read
from statechat.cache.blobs.encoding import BlobError, BlobMeta
from statechat.cache.blobs.read import read_blob
from statechat.cache.blobs.write import write_blob

FP = "ab" * 32
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def sample(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "k.0": torch.randn(3, 64, 4, 8, generator=gen).to(torch.bfloat16),
        "v.0": torch.randn(3, 64, 4, 8, generator=gen).to(torch.float16),
        "ssm.0": torch.randn(5, 7, 11, generator=gen),
        "ids": torch.randint(-(2**40), 2**40, (37,), generator=gen),
        "bytes": torch.randint(0, 256, (1001,), generator=gen, dtype=torch.uint8),
        "empty": torch.zeros(0, 4),
    }


def shapes(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for n, t in tensors.items()}


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 1000 bytes, so a small blob has many (the format's are 16 MiB)."""
    monkeypatch.setattr(encoding, "PIECE_BYTES", 1000)


@pytest.fixture
def blob(tmp_path, small_pieces):
    tensors = sample(torch.Generator().manual_seed(0))
    path = tmp_path / "kv" / "a.safetensors"
    _, crc = write_blob(path, tensors, BlobMeta(FP, 192, ["00"] * 3, "kv"))
    return path, tensors, crc


def data_start(path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def refused(path, expected, **kwargs) -> str:
    with pytest.raises(BlobError) as err:
        read_blob(path, FP, expected, **kwargs)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_blob_is_a_plain_safetensors_file(blob):
    """Written without safetensors' own writer, a blob is still one it reads: the same tensors,
    and our metadata."""
    from safetensors import safe_open

    path, tensors, crc = blob
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(tensors)
        for name, t in tensors.items():
            assert torch.equal(f.get_tensor(name), t), name
        meta = f.metadata()
    assert meta["checksum"] == crc and meta["fingerprint"] == FP and meta["kind"] == "kv"
    assert json.loads(meta["hashes"]) == ["00"] * 3 and meta["num_tokens"] == "192"


def test_writer_pauses_once_per_piece_of_data(tmp_path, small_pieces):
    """The store's writer holds back between pieces of work: the pause runs before the first
    piece and then once per PIECE_BYTES of data written, however many small tensors there are."""
    tensors = sample(torch.Generator().manual_seed(1))
    tensors.update({f"tiny.{i}": torch.ones(3) for i in range(40)})  # many tensors, few bytes
    calls = []
    path = tmp_path / "b.safetensors"
    write_blob(path, tensors, BlobMeta(FP, 1, ["00"], "kv"), lambda: calls.append(1))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert total // 2000 <= len(calls) <= total // 1000 + 1
    assert read_blob(path, FP, shapes(tensors)).keys() == tensors.keys()


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_is_exact(blob, device):
    path, tensors, crc = blob
    got = read_blob(path, FP, shapes(tensors), crc, device=device)
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        assert got[name].device.type == device and got[name].dtype == t.dtype
        assert torch.equal(got[name].cpu(), t), name


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_of_a_tensor_larger_than_a_piece(tmp_path, device):
    tensors = {"k.0": torch.arange(encoding.PIECE_BYTES // 4 + 3, dtype=torch.int32),
               "v.0": torch.ones(5)}
    path = tmp_path / "big.safetensors"
    _, crc = write_blob(path, tensors, BlobMeta(FP, 64, ["00"], "kv"))
    got = read_blob(path, FP, shapes(tensors), crc, device=device)
    assert all(torch.equal(got[n].cpu(), t) for n, t in tensors.items())


@pytest.mark.parametrize("run_bytes", [1, 2500, 1 << 20])
@pytest.mark.parametrize("device", DEVICES)
def test_pieces_are_read_in_runs(blob, device, run_bytes, monkeypatch):
    """Adjacent pieces are read (and copied to a device) together, up to RUN_BYTES a run (a
    larger piece alone), and each keeps its own checksum: the tensors round-trip, one read
    per run, and a byte flipped in any piece of a run is still refused."""
    path, tensors, crc = blob
    monkeypatch.setattr(blob_read, "RUN_BYTES", run_bytes)
    reads, read_into = [], blob_read._read_into
    monkeypatch.setattr(
        blob_read, "_read_into",
        lambda fd, offset, out: reads.append(len(out)) or read_into(fd, offset, out),
    )
    got = read_blob(path, FP, shapes(tensors), crc, device=device)
    assert all(torch.equal(got[n].cpu(), t) for n, t in tensors.items())
    data = path.stat().st_size - data_start(path)
    assert sum(reads) == data and max(reads) <= max(run_bytes, 1000)
    pieces = sum(max(1, -(-t.numel() * t.element_size() // 1000)) for t in tensors.values())
    if run_bytes == 1:
        assert len(reads) == pieces  # no two pieces fit a run
    elif run_bytes == 2500:
        assert 1 < len(reads) < pieces
    else:
        assert len(reads) == 1
    raw = bytearray(path.read_bytes())
    raw[data_start(path) + data // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    assert "fails its checksum" in refused(path, shapes(tensors), checksum_in_index=crc,
                                           device=device)


def test_checksum_follows_the_documented_formula(small_pieces):
    """crc32 of "name:crc.crc...,name:crc" over 1000-byte pieces, tensors in name order."""
    a, b = torch.arange(600, dtype=torch.int32), torch.zeros(0)
    raw = a.numpy().tobytes()
    crcs = [f"{zlib.crc32(raw[o : o + 1000]):08x}" for o in (0, 1000, 2000)]
    text = "a:" + ".".join(crcs) + ",b:00000000"
    assert blob_read.checksum({"b": b, "a": a}) == f"{zlib.crc32(text.encode()):08x}"


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("device", DEVICES)
def test_flipped_byte_in_any_piece_is_refused(blob, where, device):
    path, tensors, crc = blob
    data = bytearray(path.read_bytes())
    start = data_start(path)
    at = {"first": start, "middle": (start + len(data)) // 2, "last": len(data) - 1}[where]
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    message = refused(path, shapes(tensors), checksum_in_index=crc, device=device)
    assert "fails its checksum" in message


@pytest.mark.parametrize("keep", [4, 100, "header", "data"])
def test_truncated_blob_is_refused(blob, keep):
    path, tensors, _ = blob
    data = path.read_bytes()
    start = data_start(path)
    cut = {"header": start - 10, "data": (start + len(data)) // 2}.get(keep, keep)
    path.write_bytes(data[:cut])
    assert "unreadable" in refused(path, shapes(tensors))


def test_index_checksum_must_match(blob):
    path, tensors, _ = blob
    assert "fails its checksum" in refused(path, shapes(tensors), checksum_in_index="00000000")


def test_header_mismatches_are_refused(blob, tmp_path):
    path, tensors, _ = blob
    expected = shapes(tensors)
    with pytest.raises(BlobError, match="belongs to another model"):
        read_blob(path, "cd" * 32, expected)
    assert "holds other tensors" in refused(path, {**expected, "k.1": (3, 64, 4, 8)})
    assert "tensor ssm.0 has shape [5, 7, 11]" in refused(path, {**expected, "ssm.0": (5, 7, 12)})
    assert "missing" in refused(tmp_path / "nothing.safetensors", expected)


def test_older_format_is_refused(blob):
    path, tensors, _ = blob
    data = path.read_bytes()
    start = data_start(path)
    header = json.loads(data[8:start])
    header["__metadata__"]["format_version"] = "1"
    text = json.dumps(header, separators=(",", ":")).encode().ljust(start - 8)  # offsets kept
    path.write_bytes(data[:8] + text + data[start:])
    assert "has cache format 1" in refused(path, shapes(tensors))


def test_resident_fraction_counts_the_cached_pages(tmp_path, monkeypatch):
    """Half of a file written, the other half a hole never read: half of its pages are in the
    page cache, asked of every page of a small file and of evenly spaced windows of a large
    one. A file that is not there is cold."""
    libc, calls = residency._libc(), []

    class Counting:  # the real calls, with mincore's lengths recorded
        mmap, munmap = libc.mmap, libc.munmap

        @staticmethod
        def mincore(addr, length, vec):
            calls.append(length.value)
            return libc.mincore(addr, length, vec)

    monkeypatch.setattr(residency, "_libc", lambda: Counting)
    page = residency._PAGE
    sampled = residency.RESIDENT_SAMPLES * residency.RESIDENT_WINDOW * page
    for size in (sampled // 2 + 100, 4 * sampled + 100):  # whole file asked; windows asked
        path = tmp_path / f"half-{size}"
        with open(path, "wb") as f:
            f.write(b"x" * (size // 2))
            f.truncate(size)
        calls.clear()
        assert residency.resident_fraction(path) == pytest.approx(0.5, abs=0.02), size
        if size < sampled:
            assert calls == [size]
        else:
            assert calls == [residency.RESIDENT_WINDOW * page] * residency.RESIDENT_SAMPLES
    assert residency.resident_fraction(tmp_path / "missing") == 0.0


def test_the_names_the_store_writes_are_those_its_clean_ups_know():
    """gc, verify and clear remove only files named as BLOB_NAME says; the blobs and the temps
    that writing makes must match it, or they would be left behind (or kept as orphans)."""
    from statechat.cache.blobs.encoding import BLOB_NAME, ckpt_blob_name, kv_blob_name, temp_name

    names = [kv_blob_name(), ckpt_blob_name("ab" * 32)]
    for name in names + [temp_name(n) for n in names]:
        assert BLOB_NAME.fullmatch(name), name
    assert not BLOB_NAME.fullmatch(names[0] + ".partial")


@pytest.mark.parametrize("fail_at", ["data", "fsync"])
def test_a_write_that_fails_leaves_no_file_behind(tmp_path, monkeypatch, fail_at):
    """A full disk midway through a blob (or at its fsync) raises, and neither the blob nor
    its temporary file stays: each failed save left its partial temp, up to a whole blob, on
    the very disk that had no room."""
    from statechat.cache.blobs import write as blob_write

    def no_room(*args):
        raise OSError(28, "No space left on device")

    real_pwrite, written = blob_write.os.pwrite, []

    def pwrite(fd, data, offset):  # the first piece goes in, then the disk is full
        if written:
            no_room()
        written.append(len(data))
        return real_pwrite(fd, data, offset)

    if fail_at == "data":
        monkeypatch.setattr(blob_write.os, "pwrite", pwrite)
    else:
        monkeypatch.setattr(blob_write.os, "fsync", no_room)
    tensors = sample(torch.Generator().manual_seed(0))
    target = tmp_path / "kv" / "blob.safetensors"
    with pytest.raises(OSError, match="No space left"):
        write_blob(target, tensors, BlobMeta(FP, 64, ["cd" * 32], "kv"))
    assert list((tmp_path / "kv").iterdir()) == []


def test_a_folder_removed_between_its_making_and_the_write_is_made_again(tmp_path, monkeypatch):
    """`statechat cache clear` in another process removes the blob folders it empties; one
    removed just after a writer made it failed that save (`No such file or directory`, a
    warning and a checkpoint lost). Now the writer makes the folder again."""
    from pathlib import Path

    mkdir = Path.mkdir
    removed = []

    def mkdir_then_cleared(self, *args, **kwargs):
        mkdir(self, *args, **kwargs)
        if not removed and self.name == "ab":
            removed.append(self)
            self.rmdir()

    monkeypatch.setattr(Path, "mkdir", mkdir_then_cleared)
    path = tmp_path / "ckpt" / "ab" / "blob.safetensors"
    tensors = {"k.0": torch.ones(1, 64, 2, 4)}
    _, crc = write_blob(path, tensors, BlobMeta(FP, 64, ["00"], "kv"))
    assert removed and read_blob(path, FP, shapes(tensors), crc)["k.0"].equal(tensors["k.0"])
