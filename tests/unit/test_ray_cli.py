"""The Ray verbs without a cluster: nothing imports Ray unless asked, without Ray each verb says how to
install it, and a bad job config is one line before Ray starts (on a Ray cluster: tests/dist/test_ray.py)."""
import subprocess
import sys

from launch import REPO, TINY
from messages import naming


def test_nothing_imports_ray_unless_asked_and_without_it_the_verbs_say_how_to_install_it():
    """One interpreter (imports cost seconds): bigtrain's CLI, job and Ray modules import no Ray;
    with Ray made unimportable, each Ray verb says in one line how to install it."""
    code = ("import sys\n"
            "import bigtrain.cli, bigtrain.train.job, bigtrain.launch.ray_train, bigtrain.launch.tune\n"
            "bigtrain.cli.build_parser()\n"
            "print('ray modules', sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
            "sys.modules['ray'] = None\n"
            "print('exit', bigtrain.cli.main(['ray-train', '--num-workers', '2', '--steps', '2']))\n"
            "print('exit', bigtrain.cli.main(['tune', '--steps', '2']))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("ray modules", "exit"))]
    assert lines == ["ray modules []", "exit 2", "exit 2"], proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("bigtrain ")]
    assert [line.split(": ")[0] for line in errors] == ["bigtrain ray-train", "bigtrain tune"], proc.stderr
    for line in errors:  # what is missing, and both ways to install it
        assert naming(line, "Ray", "not installed", "pip install 'bigtrain[ray]'", "pip install 'ray[train,tune]'"), line
    assert "Traceback" not in proc.stderr


def test_a_bad_job_config_is_one_line_before_ray_starts(capsys, monkeypatch):
    import bigtrain.launch.ray_train as ray_train
    from bigtrain.cli import main

    def no_cluster(*args, **kwargs):
        raise AssertionError("Ray was started for a job config that cannot run")
    monkeypatch.setattr(ray_train, "connect", no_cluster)
    code = main(["ray-train", "--num-workers", "2", *TINY, "--set", "zero.stage=2", "--set", "pipeline.stages=2"])
    err = capsys.readouterr().err
    assert code == 2 and naming(err, "zero.stage=2", "pipeline stages", "ZeRO 0-1") and "Traceback" not in err, err
    assert main(["ray-train", "--num-workers", "2", "--no-such-flag"]) == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
    assert main(["tune", "--lr", "0.1:0.01", *TINY]) == 2
    assert "--lr '0.1:0.01': give LOW:HIGH" in capsys.readouterr().err
