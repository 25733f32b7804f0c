"""README.md's toy journey (preprocess, pretrain, plot, merge, generate on the shipped sample) runs as written in
an activated .venv: the block is read from the README itself, with its runs/ folder moved to a temporary one."""
import os
import re
import subprocess
import sys

from tests.launch import ROOT, env


def readme_journey():
    """The commands of the README block that starts with `mkdir -p runs`, as one shell script."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"\n    mkdir -p runs\n(?:    .*\n)+", text)
    assert match, "README.md lost its toy journey (the block starting `mkdir -p runs`)"
    return "".join(line[4:] + "\n" for line in match.group(0).strip("\n").splitlines())


def test_readme_journey_runs_as_written(tmp_path):
    script = readme_journey()
    commands = [line.split()[1] for line in script.splitlines() if line.startswith("python ")]
    assert commands == ["tools/preprocess_data.py", "pretrain_bloom.py", "tools/plot_metrics.py",
                        "tools/merge_mp_partitions.py", "tools/generate_text.py"]
    runs = tmp_path / "runs"
    script = script.replace("mkdir -p runs", f"mkdir -p {runs}").replace("runs/", f"{runs}/")
    activated = env({"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
                     "VIRTUAL_ENV": os.path.dirname(os.path.dirname(sys.executable))})
    proc = subprocess.run(["bash", "-ec", script], cwd=ROOT, env=activated, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert sorted(p for p in os.listdir(runs) if not p.endswith(".npy")) == [
        "bloom_final", "checkpoints", "curves.png", "sample_text_document.bin", "sample_text_document.idx"]
    assert "--- continuation (16 tokens" in proc.stdout
    assert "wrote " + str(runs / "curves.png") + " (4 training and 2 validation points)" in proc.stdout + proc.stderr
