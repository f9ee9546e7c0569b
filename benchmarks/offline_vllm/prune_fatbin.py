"""Drop from the CUDA fat binaries inside ELF shared objects the GPU code (cubins) that a Hopper GPU
(sm_90: H100, H200) can never load, so that vLLM's kernels travel in fewer parts.

Why it is safe on Hopper: a cubin built for sm_XY runs only on GPUs of the same major architecture
(sm_XZ with Z >= Y). On sm_90 the driver therefore loads a container's sm_90/sm_90a cubin, or else
JIT-compiles its PTX; cubins for sm_7x, sm_8x, sm_10x and sm_12x are never loaded there. Every
container keeps its sm_9x cubins and all its PTX byte for byte (build.sh's check compares them with
cuobjdump when it is at hand); a container that would be left with nothing is not touched. The
pruned libraries do NOT run on Ampere, Ada or Blackwell GPUs (build with PRUNE_SASS=0 for those).

How: the file keeps its size and layout. A pruned container (one `__cudaRegisterFatBinary` image,
header magic 0xBA55ED50) is rewritten in place with its kept entries and the smaller size in its
header; the bytes freed after it are zeroed, and xz packs them to almost nothing.

Usage: prune_fatbin.py [--list] [--dry-run] FILE.so...   (in place, unless --list/--dry-run)
"""
import collections
import struct
import sys

MAGIC = 0xBA55ED50
PTX, ELF = 1, 2


def nv_fatbin_section(data):
    """(offset, size) of the .nv_fatbin section of an ELF64 little-endian file, or None."""
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not an ELF64 LE file"
    (e_shoff,) = struct.unpack_from("<Q", data, 0x28)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sh = [struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize) for i in range(e_shnum)]
    stroff = sh[e_shstrndx][4]
    for s in sh:
        if data[stroff + s[0]: data.index(b"\0", stroff + s[0])] == b".nv_fatbin":
            return s[4], s[5]
    return None


def containers(data, off, size):
    """Yield (start, header_size, end, [(entry_offset, entry_bytes, kind, sm_arch), ...])."""
    pos, end = off, off + size
    while pos + 16 <= end:
        magic, _version, hsz, fsz = struct.unpack_from("<IHHQ", data, pos)
        if magic != MAGIC:  # alignment padding between containers
            pos += 8
            continue
        ents, e, cend = [], pos + hsz, pos + hsz + fsz
        assert cend <= end, f"container at {pos:#x} overruns .nv_fatbin"
        while e < cend:
            kind, _, esz, adsz, _, _dsz, _, _minor, arch = struct.unpack_from("<HHIIIIIII", data, e)
            assert esz >= 64 and e + esz + adsz <= cend, f"bad fatbin entry at {e:#x}"
            ents.append((e, esz + adsz, kind, arch))
            e += esz + adsz
        assert e == cend, f"entries of container {pos:#x} do not end at its end"
        yield pos, hsz, cend, ents
        pos = cend


def keep_on_hopper(kind, arch):
    return kind != ELF or arch // 10 == 9


def prune(path, write=True):
    data = bytearray(open(path, "rb").read())
    sec = nv_fatbin_section(data)
    if sec is None:
        return 0
    freed = 0
    for pos, hsz, cend, ents in list(containers(data, *sec)):
        keep = [(e, n) for e, n, kind, arch in ents if keep_on_hopper(kind, arch)]
        if not keep or len(keep) == len(ents):
            continue
        body = b"".join(bytes(data[e:e + n]) for e, n in keep)
        start = pos + hsz
        data[start:start + len(body)] = body
        data[start + len(body):cend] = bytes(cend - start - len(body))
        struct.pack_into("<Q", data, pos + 8, len(body))
        freed += cend - start - len(body)
    if write and freed:
        open(path, "wb").write(data)
    return freed


def listing(path):
    data = open(path, "rb").read()
    sec = nv_fatbin_section(data)
    if sec is None:
        print(f"{path}: no .nv_fatbin")
        return
    size, count = collections.Counter(), collections.Counter()
    for _, _, _, ents in containers(data, *sec):
        for _, n, kind, arch in ents:
            k = ("PTX" if kind == PTX else "ELF" if kind == ELF else hex(kind), arch)
            size[k] += n
            count[k] += 1
    print(f"{path}: .nv_fatbin {sec[1] / 1e6:.1f} MB")
    for k, v in sorted(size.items(), key=lambda kv: -kv[1]):
        print(f"  {k[0]:4} sm_{k[1]:<4} {count[k]:5} entries {v / 1e6:8.2f} MB")


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--list" in args:
        for p in args:
            if p != "--list":
                listing(p)
        sys.exit(0)
    dry = "--dry-run" in args
    for p in [a for a in args if a != "--dry-run"]:
        print(f"{p}: {prune(p, write=not dry) / 1e6:.1f} MB of non-Hopper cubins dropped{' (dry run)' if dry else ''}")
