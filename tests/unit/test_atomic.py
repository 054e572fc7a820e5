"""bigtrain.atomic, the one writer of files read back: a writer killed with SIGKILL at any point leaves the previous
file whole and a stray temporary that nothing reads or renames later; the file and its folder are fsynced around the
rename (a power cut never leaves the new name on empty contents); and no other module of bigtrain renames a file into
place by itself."""
from __future__ import annotations

import ast
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from bigtrain.atomic import replacing, temporaries, write_atomic

REPO = Path(__file__).resolve().parents[2]
PAYLOAD = 16 << 20  # 16 MiB: a write of many system calls and pages, as a shard or a table is

# The child writes the target and says where it is; it then waits on stdin (which the parent never closes) for the
# SIGKILL, so the kill lands at that point every time, not when the scheduler happens to allow.
WRITER = """
import os, sys
from bigtrain.atomic import replacing, write_atomic
target, point, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
if point == "mid-write":  # half of the payload written through the open temporary
    with replacing(target) as f:
        f.write(b"n" * (size // 2))
        f.flush()
        print("half written", flush=True)
        sys.stdin.read()
        f.write(b"n" * (size - size // 2))
elif point == "synced":  # all of it written and fsynced, the rename not yet made
    real_fsync = os.fsync
    def stall(fd):
        real_fsync(fd)
        print("synced", flush=True)
        sys.stdin.read()
    os.fsync = stall
    write_atomic(target, b"n" * size)
else:  # a writer in a loop, killed whenever the parent gets to it: the file is always one whole version
    for i in range(1_000_000):
        write_atomic(target, bytes([65 + i % 26]) * size)
        if i == 2:
            print("third written", flush=True)
"""


def kill_writer_at(target: Path, point: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(target), point, str(PAYLOAD)], cwd=REPO,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        said = child.stdout.readline()
        assert said, f"the writer ended before reaching {point!r} (exit {child.wait()})"
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        child.kill()
        child.stdin.close()
        child.stdout.close()


@pytest.mark.parametrize("point", ["mid-write", "synced"])
def test_a_writer_killed_mid_write_leaves_the_previous_file_whole_and_its_temporary_unused(tmp_path, point):
    target = tmp_path / "summary.json"
    previous = b'{"step": 7}\n' * 1000
    write_atomic(target, previous)
    kill_writer_at(target, point)
    assert target.read_bytes() == previous  # the reader sees the old file, not the killed writer's bytes
    stray, = temporaries(target)  # the killed writer's temporary, hidden beside the file
    assert stray.name.startswith(".summary.json.") and 0 < stray.stat().st_size <= PAYLOAD
    left = stray.read_bytes()

    write_atomic(target, b"the next writer's")  # a later writer is not confused by the stray ...
    assert target.read_bytes() == b"the next writer's"
    assert temporaries(target) == [stray] and stray.read_bytes() == left  # ... and never renames or reads it
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, stray.name])


def test_a_writer_in_a_loop_killed_at_any_moment_leaves_one_whole_version(tmp_path):
    target = tmp_path / "marker"
    kill_writer_at(target, "loop")
    data = target.read_bytes()
    assert len(data) == PAYLOAD and data == data[:1] * PAYLOAD  # one version, whole: never two mixed or a prefix
    assert len(temporaries(target)) <= 1


def test_the_file_then_its_folder_are_fsynced_around_the_rename(tmp_path, monkeypatch):
    """The order a power cut needs: the data on disk before the name points at it, and the name itself on disk
    before the writer returns. Without the file's fsync, ext4/xfs may persist the rename before the data."""
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(
        "fsync folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("rename"), real_replace(a, b))[1])
    write_atomic(tmp_path / "a.json", "{}")
    assert events == ["fsync file", "rename", "fsync folder"]

    events.clear()
    with replacing(tmp_path / "b.bin") as f:  # the streaming form: a shard, a table, a plot
        f.write(b"\0" * 10)
    assert events == ["fsync file", "rename", "fsync folder"]
    assert (tmp_path / "a.json").read_text() == "{}" and (tmp_path / "b.bin").read_bytes() == b"\0" * 10


def test_an_error_inside_the_block_leaves_the_previous_file_and_no_temporary(tmp_path):
    target = tmp_path / "00001.bin"
    write_atomic(target, b"whole")
    with pytest.raises(ValueError, match="bad record"):
        with replacing(target) as f:
            f.write(b"half")
            raise ValueError("bad record")
    assert target.read_bytes() == b"whole" and temporaries(target) == []
    with pytest.raises(ValueError, match="mode 'ab'"):
        with replacing(target, "ab"):
            pass


def test_text_is_written_as_utf8_and_the_path_returned(tmp_path):
    path = write_atomic(tmp_path / "page.md", "ñ → ✓\n")
    assert path == tmp_path / "page.md" and path.read_bytes() == "ñ → ✓\n".encode()


# Folder swaps (a staging folder renamed into place) are the one other rename, and only these do it.
FOLDER_SWAPS = {"bigtrain/export/write.py", "bigtrain/data/tokenizer.py", "bigtrain/data/prepare/core.py",
                "bigtrain/data/cache.py", "bigtrain/checkpoint/universal.py", "bigtrain/checkpoint/store.py"}


def renames_in(path: Path) -> int:
    """Calls of os.replace / os.rename, and Path.replace / Path.rename (one argument: str.replace takes two)."""
    count = 0
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("replace", "rename"):
            on_os = isinstance(node.func.value, ast.Name) and node.func.value.id == "os"
            count += on_os or (len(node.args) == 1 and not node.keywords)
    return count


def test_no_module_renames_a_file_into_place_by_itself():
    found = {str(p.relative_to(REPO)) for folder in ("bigtrain", "scripts") for p in (REPO / folder).rglob("*.py")
             if p.name != "atomic.py" and renames_in(p)}
    assert found <= FOLDER_SWAPS, f"{sorted(found - FOLDER_SWAPS)} rename a file into place: use bigtrain.atomic"
