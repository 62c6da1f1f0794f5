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


def test_a_log_another_program_appends_to_is_rotated_in_place(tmp_path):
    """A Slurm job's output (opened with O_APPEND by slurmstepd): copied to .1, truncated where it is;
    the writer's next line lands at the start of the emptied file, the older ones in .1 … .keep."""
    import os

    from pipeline.stages.logfile import rotate_in_place

    log = tmp_path / "train.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for round_ in range(4):
            os.write(fd, f"round {round_}\n".encode() * 20)
            assert rotate_in_place(log, max_bytes=100, keep=2)
        os.write(fd, b"after\n")
        assert not rotate_in_place(log, max_bytes=100, keep=2)  # under the cap: left alone
    finally:
        os.close(fd)
    assert log.read_bytes() == b"after\n"
    assert (tmp_path / "train.log.1").read_text() == "round 3\n" * 20
    assert (tmp_path / "train.log.2").read_text() == "round 2\n" * 20
    assert not (tmp_path / "train.log.3").exists()
    assert not rotate_in_place(tmp_path / "missing.log", max_bytes=1, keep=2)
