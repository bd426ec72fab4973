"""nanolp/runs.py: the git state a run records (train.py records the rest: tests/test_train.py), and what a
log says of its run."""

import subprocess

from nanolp import runs


def test_git_state_outside_a_checkout(tmp_path):
    assert runs.git_state(tmp_path) == (None, None)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "f").write_text("a")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["add", "f"], check=True)
    subprocess.run(git + ["commit", "-qm", "f"], check=True)
    commit, dirty = runs.git_state(tmp_path)
    assert len(commit) == 40 and dirty is False
    (tmp_path / "f").write_text("b")
    assert runs.git_state(tmp_path) == (commit, True)


def test_log_outcome_reads_a_log_as_train_py_summarises_it(tmp_path):
    (tmp_path / "log.csv").write_text(
        "step,elapsed_s,train_loss,val_loss,tokens_per_s,max_logit_L0,max_logit_L1\n"
        "10,6,3.0,2.9,100,,\n20,12,2.0,,300,5.0,7.5\n30,18,nan,,200,,\n")
    outcome = runs.log_outcome(runs.read_log(tmp_path / "log.csv"))
    assert outcome == dict(steps=30, minutes=0.3, final_val_loss=2.9, final_train_loss=None,  # ended non-finite
                           max_logit=7.5, tokens_per_s=200.0)
    (tmp_path / "summary.json").write_text('{"steps": 40, "final_val_loss": null}')
    run = runs.load_run(tmp_path)   # the summary's values where it has them, the log's elsewhere
    assert run.outcome["steps"] == 40 and run.outcome["final_val_loss"] == 2.9 and run.outcome["max_logit"] == 7.5
