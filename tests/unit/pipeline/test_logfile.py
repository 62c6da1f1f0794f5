"""Log rotation and tailing."""

from pipeline.stages.logfile import RotatingLog, tail_lines


def test_rotation_keeps_k_files_and_loses_nothing_recent(tmp_path):
    path = tmp_path / "s.log"
    log = RotatingLog(path, max_bytes=1000, keep=2)
    for i in range(100):
        log.write(f"line {i:04d} {'x' * 40}\n".encode())
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["s.log", "s.log.1", "s.log.2"]
    assert all(p.stat().st_size <= 1000 for p in tmp_path.iterdir())
    newest = (path.with_name("s.log.2").read_text() + path.with_name("s.log.1").read_text() + path.read_text())
    numbers = [int(line.split()[1]) for line in newest.splitlines()]
    assert numbers == list(range(numbers[0], 100))


def test_tail_lines(tmp_path):
    path = tmp_path / "t.log"
    path.write_text("".join(f"{i}\n" for i in range(10000)))
    assert tail_lines(path, 3) == ["9997", "9998", "9999"]
    assert tail_lines(path, 3, block=7) == ["9997", "9998", "9999"]
    assert tail_lines(tmp_path / "missing", 3) == []
