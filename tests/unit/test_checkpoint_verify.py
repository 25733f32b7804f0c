"""--load's verification shared by the ranks (megatron/checkpoint/verify.py): every file read once, by one rank,
the bytes balanced; a corrupt file found on any rank makes every rank skip that checkpoint with the reason; the
collective is bounded by its own timeout, not --distributed-timeout-minutes. Two gloo processes, one spawn."""
import json
import os
import time


from megatron.checkpoint import format as fmt
from megatron.checkpoint import verify
from megatron.checkpoint.format import CheckpointError, tag_for
from megatron.checkpoint.io import write_manifest
from tests.distributed import run_distributed

SIZES = [9000, 7000, 5000, 3000, 2000, 1000, 500]  # bytes of the files of each checkpoint


def make(root, iteration):
    folder = os.path.join(root, tag_for(iteration))
    os.makedirs(folder)
    for i, size in enumerate(SIZES):
        with open(os.path.join(folder, f"file{i}.bin"), "wb") as f:
            f.write(bytes([iteration + i]) * size)
    write_manifest(folder, iteration)
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(tag_for(iteration))
    return folder


def test_share_balances_bytes_and_gives_every_file_to_one_rank():
    files = {f"f{i}": {"size": size, "crc32": 0} for i, size in enumerate(SIZES)}
    owner = verify.share(files, 2)
    assert owner == {"f0": 0, "f1": 1, "f2": 1, "f3": 0, "f4": 0, "f5": 1, "f6": 1}  # greedy, largest first
    assert [sum(files[f]["size"] for f in owner if owner[f] == r) for r in (0, 1)] == [14000, 13500]
    assert set(verify.share(files, 16).values()) == set(range(7))


def _ranks_verify(rank, world_size, root, out):
    reads = []
    real_crc = fmt.file_crc32

    def recording_crc(path, *args):
        reads.append(os.path.relpath(path, root))
        if path.endswith("file6.bin") and "slow" in path and rank == 1:
            time.sleep(5)  # past the 0.05-minute (3 s) budget below
        return real_crc(path, *args)

    fmt.file_crc32 = recording_crc
    chosen, _ = verify.choose_checkpoint(root, timeout_minutes=1)
    answer = {"chosen": chosen, "reads": reads}
    try:
        verify.choose_checkpoint(os.path.join(root, "slow", tag_for(2)), timeout_minutes=0.05)
    except CheckpointError as err:
        answer["timeout"] = str(err)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(answer, f)


def test_ranks_share_the_reads_agree_on_a_corrupt_file_and_time_out_on_their_own_budget(tmp_path):
    root = tmp_path / "ckpt"
    make(root, 2)
    latest = make(root, 4)
    os.truncate(os.path.join(latest, "file2.bin"), 10)  # file2 is rank 1's (share above)
    make(root / "slow", 2)
    run_distributed(_ranks_verify, 2, str(root), str(tmp_path))
    answers = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    assert [a["chosen"] for a in answers] == [str(root / "iter_0000002")] * 2  # both ranks skipped iter_0000004
    reads = [[p for p in a["reads"] if p.startswith("iter_0000002")] for a in answers]
    assert sorted(reads[0] + reads[1]) == sorted(f"iter_0000002/file{i}.bin" for i in range(len(SIZES)))
    assert sorted(reads[1]) == ["iter_0000002/file1.bin", "iter_0000002/file2.bin", "iter_0000002/file5.bin",
                               "iter_0000002/file6.bin"]
    assert "iter_0000004/file2.bin" not in answers[0]["reads"]  # rank 1 found it; rank 0 did not read it
    for answer in answers:
        assert "did not finish on every rank within --checkpoint-verify-timeout-minutes 0.05" in answer["timeout"]
