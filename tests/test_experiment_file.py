"""Bad experiment files: `testbed run` refuses each with exit code 2 and a message naming the file, the line,
the field and the problem, before anything is built (no output directory, no namespaces). Pure: runs without
root. The same loader reads topology files (tests/test_topo_validation.py)."""

from __future__ import annotations

import pytest

from conftest import ROOT, tb_cli
from testbed.experiments.spec import Experiment
from testbed.topo import TopologyError
from testbed.yamlfile import InputError, parse_yaml

PAIR = ROOT / "topologies" / "pair.yaml"

GOOD = f"""name: check
model: tiny
steps: 4
topologies:
  ddp: {PAIR}
grid:
  mode: [ddp]
  ber: [0, 1e-5]
train:
  batch_size: 4
"""


def write(tmp_path, text: str, name: str = "exp.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def refused(tmp_path, path) -> str:
    """Run `testbed run` on the file; it must exit 2 without a traceback and without creating --out."""
    out = tmp_path / "out"
    r = tb_cli("run", str(path), "--out", str(out))
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr
    assert not out.exists()
    return r.stderr.strip()


def test_duplicate_key_exits_2_naming_the_line(tmp_path):
    path = write(tmp_path, GOOD.replace("steps: 4\n", "steps: 4\nsteps: 40\n"))
    msg = refused(tmp_path, path)
    assert msg == f"{path}:4: not valid YAML (column 1): duplicate key 'steps' (first on line 3)"


def test_bad_field_value_exits_2_naming_the_line(tmp_path):
    path = write(tmp_path, GOOD.replace("ber: [0, 1e-5]", "ber: [0, 0.9]"))
    msg = refused(tmp_path, path)
    assert msg.startswith(f"{path}:8: grid.ber[1]: "), msg
    assert "[0, 0.5]" in msg


def test_every_problem_is_reported_in_file_order(tmp_path):
    text = GOOD.replace("steps: 4", "steps: 0").replace("batch_size: 4", "batch_size: 4\n  bacth: 2")
    with pytest.raises(InputError) as e:
        Experiment.load(write(tmp_path, text))
    lines = str(e.value).splitlines()
    assert [line.split(": ")[1] for line in lines] == ["steps", "train.bacth"]
    assert lines[0].startswith(f"{tmp_path / 'exp.yaml'}:3: steps: ")
    assert lines[1].endswith("train.bacth: unknown key (check its spelling and the documented fields)")


def test_missing_key_names_the_mapping_that_lacks_it(tmp_path):
    with pytest.raises(InputError) as e:
        Experiment.load(write(tmp_path, GOOD.replace("  mode: [ddp]\n", "")))
    assert str(e.value) == f"{tmp_path / 'exp.yaml'}:6: grid.mode: required field is missing"


def test_topology_problems_name_both_files(tmp_path):
    topo = write(tmp_path, 'name: t\ntopology:\n  nodes: {h1: {}, h2: {}}\n  links:\n'
                           '    - endpoints: ["h1:eth1", "h2:eth1"]\n      ber: 0.9\n', "topo.yaml")
    text = GOOD.replace(str(PAIR), str(topo)).replace("mode: [ddp]", "mode: [ddp, pp]")
    with pytest.raises(TopologyError) as e:  # TopologyError is the loader's InputError: one exit code for both
        Experiment.load(write(tmp_path, text))
    assert str(e.value).splitlines() == [
        f"{tmp_path / 'exp.yaml'}:4: topologies.pp: grid runs mode pp but names no topology for it",
        f"{tmp_path / 'exp.yaml'}:5: topologies.ddp: {topo}:6: topology.links[0].ber: must lie in [0, 0.5], got 0.9"]


def test_latency_section_is_checked_before_training(tmp_path):
    text = GOOD + f"latency: {{topology: {PAIR}, link: h1-h9}}\n"
    with pytest.raises(InputError) as e:
        Experiment.load(write(tmp_path, text))
    assert str(e.value).startswith(f"{tmp_path / 'exp.yaml'}:11: latency.link: topology 'pair' has no link 'h1-h9'")


@pytest.mark.parametrize("text,words", [
    ("", "the file is empty"),
    ("- name: check\n", ":1: the file must hold a mapping"),
    ("name: [check\n", "not valid YAML"),
])
def test_files_that_are_no_experiment(tmp_path, text, words):
    with pytest.raises(InputError) as e:
        Experiment.load(write(tmp_path, text))
    assert words in str(e.value)


def test_unreadable_file(tmp_path):
    with pytest.raises(InputError, match="cannot read file"):
        Experiment.load(tmp_path / "missing.yaml")


def test_good_file_loads(tmp_path):
    exp = Experiment.load(write(tmp_path, GOOD))
    assert [p.id for p in exp.points()] == ["ddp-ber0-tensor-fix-s1", "ddp-ber1e-5-tensor-fix-s1"]


def test_line_index_covers_nested_paths():
    data, lines = parse_yaml("a:\n  b:\n    - x: 1\n    - {x: 2, y: 3}\nc: [1, 2]\n", "f.yaml")
    assert data == {"a": {"b": [{"x": 1}, {"x": 2, "y": 3}]}, "c": [1, 2]}
    assert lines == {"": 1, "a": 1, "a.b": 2, "a.b[0]": 3, "a.b[0].x": 3, "a.b[1]": 4, "a.b[1].x": 4,
                     "a.b[1].y": 4, "c": 5, "c[0]": 5, "c[1]": 5}
    assert InputError("f.yaml", [("a.b[1].z", "unknown key")], lines).render() == "f.yaml:4: a.b[1].z: unknown key"
