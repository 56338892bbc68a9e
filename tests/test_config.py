"""Configuration: `key = value` files parsed (never executed), typed overrides, one-line errors; get_lr."""

import math
from dataclasses import dataclass, field
from typing import Optional

import pytest

from conftest import assert_one_error_line, assert_one_line, run_in_process, tiny_train_args, train
from machinery import configurator
from machinery.errors import UserError
from optimizers import get_lr
import sample
from train import TrainConfig


@dataclass
class Settings:
    name: str = field(default="out", metadata={"help": "a string"})
    steps: int = field(default=10, metadata={"help": "an int"})
    rate: float = field(default=0.5, metadata={"help": "a float"})
    flag: bool = field(default=False, metadata={"help": "a bool"})
    limit: Optional[int] = field(default=None, metadata={"help": "an optional int"})
    maybe: Optional[bool] = field(default=None, metadata={"help": "an optional bool"})
    betas: tuple[float, float] = field(default=(0.9, 0.95), metadata={"help": "a pair"})


def parse(*argv):
    return configurator.parse(Settings, [str(a) for a in argv])


def config_file(tmp_path, text, name="cfg.py"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults():
    assert parse() == Settings()


def test_config_file_key_value_lines(tmp_path):
    path = config_file(tmp_path, '"""A docstring is allowed."""\n# and comments\n'
                                 'name = "run-1"  # trailing comment\nsteps = 200\nrate = 1e-3\nflag = True\n'
                                 'limit = 5\nbetas = (0.8, 0.99)\n')
    assert parse(path) == Settings(name="run-1", steps=200, rate=1e-3, flag=True, limit=5, betas=(0.8, 0.99))


def test_override_order(tmp_path):
    """Defaults, then config files in order, then --key=value arguments, wherever they stand."""
    first = config_file(tmp_path, "steps = 1\nrate = 0.1\nname = 'first'\n", "first.py")
    second = config_file(tmp_path, "steps = 2\n", "second.py")
    cfg = parse(first, second)
    assert (cfg.steps, cfg.rate, cfg.name) == (2, 0.1, "first")
    assert parse(first, second, "--steps=3").steps == 3
    assert parse("--steps=3", first, second).steps == 3  # the command line wins even before the file
    assert parse("--steps=3", "--steps=4").steps == 4  # the last of repeated arguments wins


@pytest.mark.parametrize("arg, key, value", [
    ("--steps=42", "steps", 42),
    ("--steps=1_000", "steps", 1000),
    ("--rate=3", "rate", 3.0),  # an int where a float is expected is fine
    ("--rate=6e-4", "rate", 6e-4),
    ("--flag=True", "flag", True),
    ("--flag=false", "flag", False),
    ("--flag=1", "flag", True),
    ("--name=hello world", "name", "hello world"),
    ("--name='quoted'", "name", "quoted"),
    ("--name=123", "name", "123"),  # a str setting keeps digits as text
    ("--name=", "name", ""),
    ("--limit=7", "limit", 7),
    ("--limit=None", "limit", None),
    ("--maybe=True", "maybe", True),
    ("--flag", "flag", True),  # a True/False setting alone is a switch
    ("--maybe=None", "maybe", None),
    ("--betas=(0.5, 0.6)", "betas", (0.5, 0.6)),
])
def test_command_line_values_are_converted_to_the_field_type(arg, key, value):
    got = getattr(parse(arg), key)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("argv, named", [
    (["--nope=1"], "--nope"),
    (["--steps=abc"], "--steps"),
    (["--steps=1.5"], "steps"),
    (["--steps=True"], "steps"),
    (["--rate=fast"], "--rate"),
    (["--flag=maybe"], "--flag"),
    (["--limit=1.5"], "limit"),
    (["--betas=0.9"], "betas"),
    (["--steps"], "--steps"),
    (["--maybe"], "--maybe"),  # (None, True or False: say which)
])
def test_command_line_mistakes_name_the_key(argv, named):
    with pytest.raises(UserError) as e:
        parse(*argv)
    assert_one_line(e, named)


@pytest.mark.parametrize("text, named", [
    ("nope = 1\n", "nope"),
    ("steps = 'ten'\n", "steps"),
    ("flag = 'yes'\n", "flag"),
    ("rate = None\n", "rate"),
    ("steps = 10 +\n", "cfg.py:1"),  # not Python at all
    ("steps = {[1]: 2}\n", "steps"),  # a literal that cannot be built
    ("name = 'a' 'b' +\n", "cfg.py:1"),
])
def test_config_file_mistakes_name_the_key(tmp_path, text, named):
    with pytest.raises(UserError) as e:
        parse(config_file(tmp_path, text))
    assert_one_line(e, named)


@pytest.mark.parametrize("text", [
    "import os\nos.system('touch {marker}')\n",
    "steps = __import__('os').system('touch {marker}')\n",
    "name = open('{marker}', 'w').name\n",
    "if True:\n    steps = __import__('os').system('touch {marker}')\n",
    "def f():\n    pass\nsteps = 1\n",
    "steps: int = __import__('os').system('touch {marker}')\n",
    "steps = 1; __import__('os').system('touch {marker}')\n",
    "steps = [__import__('os').system('touch {marker}')][0]\n",
    "steps = (lambda: 1)()\n",
    "steps = 10 if True else __import__('os').system('touch {marker}')\n",
])
def test_config_file_with_code_is_rejected_without_running_it(tmp_path, text):
    marker = tmp_path / "marker"
    path = config_file(tmp_path, text.format(marker=marker))
    with pytest.raises(UserError) as e:
        parse(path)
    assert "cfg.py:" in str(e.value)
    assert not marker.exists()


def test_config_file_that_cannot_be_read(tmp_path):
    with pytest.raises(UserError, match="missing.py"):
        parse(tmp_path / "missing.py")
    latin1 = tmp_path / "latin1.py"
    latin1.write_bytes(b"name = 'caf\xe9'\n")
    with pytest.raises(UserError, match="latin1.py"):
        parse(latin1)
    nul = tmp_path / "nul.py"
    nul.write_bytes(b"steps = 1\x00\n")
    with pytest.raises(UserError, match="nul.py"):
        parse(nul)


def test_help_lists_every_key_with_type_default_and_description(capsys):
    with pytest.raises(SystemExit) as e:
        parse("--help")
    assert e.value.code == 0
    out = capsys.readouterr().out
    for line, expected in [("--steps=10", "(int)  an int"), ("--limit=None", "(int | None)  an optional int"),
                           ("--rate=0.5", "(float)  a float"), ("--flag=False", "(bool)  a bool")]:
        assert f"  {line}  {expected}" in out


def test_every_train_setting_has_a_description():
    from dataclasses import fields

    assert all(f.metadata.get("help") for f in fields(TrainConfig))


def test_the_shipped_config_files_parse(tmp_path):
    from conftest import ROOT

    for path in sorted((ROOT / "config").glob("*.py")):
        values = configurator.read_config_file(str(path))
        unknown = set(values) - {f for f in TrainConfig.__dataclass_fields__}
        assert not unknown, (path.name, unknown)


# ---------------------------------------------------------------------- through train.py and sample.py (in-process:
# run_in_process runs main under errors.run_main, as the scripts' __main__ blocks do)



@pytest.mark.parametrize("arg, named", [
    ("--batch_sise=4", "batch_sise"),  # unknown key (a typo)
    ("--batch_size=four", "batch_size"),  # malformed value
    ("--batch_size=4.5", "batch_size"),  # wrong type
    ("--compile=sometimes", "compile"),
    ("--learning_rate=-1.0", "learning_rate"),  # right type, impossible value
    ("--n_embd=33", "n_embd"),
    ("--init_from=somewhere", "init_from"),
])
def test_train_config_errors_exit_2_naming_the_key(tmp_path, monkeypatch, arg, named):
    monkeypatch.chdir(tmp_path)
    proc = train(*tiny_train_args(tmp_path / "data", tmp_path / "out"), arg, check=False)
    assert named in assert_one_error_line(proc)
    assert not (tmp_path / "out").exists()


def test_train_config_file_with_code_exits_2_without_running_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "marker"
    path = config_file(tmp_path, f"batch_size = 4\nimport os\nos.system('touch {marker}')\n")
    line = assert_one_error_line(train(path, check=False))
    assert "cfg.py:2" in line
    assert not marker.exists()


def test_train_config_file_wrong_type_names_the_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = config_file(tmp_path, "max_iters = '100'\n")
    assert "max_iters" in assert_one_error_line(train(path, check=False))


def test_sample_config_errors_exit_2_naming_the_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "num_samples" in assert_one_error_line(run_in_process(sample.main, "--num_samples=two"))
    assert "--tempreature" in assert_one_error_line(run_in_process(sample.main, "--tempreature=0.5"))
    # sample.py takes no config file
    assert "cfg.py" in assert_one_error_line(run_in_process(sample.main, config_file(tmp_path, "top_k = 5\n")))
    # values of the right type that make no sense
    assert "num_samples" in assert_one_error_line(run_in_process(sample.main, "--num_samples=0"))
    assert "top_p" in assert_one_error_line(run_in_process(sample.main, "--top_p=1.5"))
    assert "ckpt" in assert_one_error_line(run_in_process(sample.main, "--ckpt=newest"))


# ---------------------------------------------------------------------- learning-rate schedule


def lr_config(**overrides):
    values = dict(learning_rate=1e-3, min_lr=1e-4, warmup_iters=10, lr_decay_iters=110, decay_lr=True)
    values.update(overrides)
    return TrainConfig(**values)


def test_lr_warmup_is_linear_and_positive_from_step_0():
    cfg = lr_config()
    lrs = [get_lr(it, cfg) for it in range(11)]
    assert lrs[0] > 0
    steps = [b - a for a, b in zip(lrs, lrs[1:10])]
    assert all(s == pytest.approx(steps[0], rel=1e-9) for s in steps) and steps[0] > 0
    assert lrs[9] < cfg.learning_rate and lrs[10] == pytest.approx(cfg.learning_rate)


def test_lr_cosine_decays_to_min_lr():
    cfg = lr_config()
    assert get_lr(10, cfg) == pytest.approx(1e-3)
    assert get_lr(60, cfg) == pytest.approx((1e-3 + 1e-4) / 2)  # half way down the cosine
    assert get_lr(35, cfg) == pytest.approx(1e-4 + 0.5 * (1 + math.cos(math.pi / 4)) * 9e-4)
    decay = [get_lr(it, cfg) for it in range(10, 111)]
    assert all(a > b for a, b in zip(decay, decay[1:]))
    assert get_lr(110, cfg) == pytest.approx(1e-4) and get_lr(10_000, cfg) == 1e-4


def test_lr_edge_cases():
    same = lr_config(warmup_iters=50, lr_decay_iters=50)  # would divide by zero in a naive cosine
    assert all(get_lr(it, same) > 0 for it in range(100))
    assert get_lr(50, same) == pytest.approx(1e-4)
    no_warmup = lr_config(warmup_iters=0)
    assert get_lr(0, no_warmup) == pytest.approx(1e-3)
    both_zero = lr_config(warmup_iters=0, lr_decay_iters=0)
    assert get_lr(0, both_zero) == pytest.approx(1e-4)
    assert get_lr(123, lr_config(decay_lr=False)) == 1e-3


def test_every_model_field_is_a_training_setting_and_reaches_the_model():
    """TrainConfig.gpt_config copies every GPTConfig field by name: each must exist as a setting, and a
    value given on the command line must arrive in the model's config."""
    from dataclasses import fields

    from model import GPTConfig

    assert {f.name for f in fields(GPTConfig)} <= {f.name for f in fields(TrainConfig)}
    cfg = configurator.parse(TrainConfig, ["--n_layer=3", "--n_head=2", "--n_embd=16", "--block_size=8",
                                           "--dropout=0.1", "--bias=True", "--gelu=tanh", "--qk_norm=True",
                                           "--mlp_ratio=3"])
    assert cfg.gpt_config(70) == GPTConfig(block_size=8, vocab_size=70, n_layer=3, n_head=2, n_embd=16, dropout=0.1,
                                           bias=True, gelu="tanh", qk_norm=True, mlp_ratio=3)


def test_given_names_what_a_config_file_or_the_command_line_set_and_a_resume_checks_only_those(tmp_path):
    """A default is not a request: resuming a 24-layer finetune with train.py's defaults (n_layer=12) resumes it,
    while n_layer=12 written in a config file or on the command line is checked against the checkpoint."""
    cfg = configurator.parse(TrainConfig, [str(config_file(tmp_path, "n_layer = 4\nbatch_size = 3\n")),
                                           "--n_embd=768", "--dropout=0.1"])
    assert configurator.given(cfg) == {"n_layer", "batch_size", "n_embd", "dropout"}  # 768: the default, but given
    assert cfg.model_settings(given_only=True) == {"n_layer": 4, "n_embd": 768, "dropout": 0.1}
    assert cfg.model_settings()["n_head"] == 12 and cfg.model_settings()["bias"] is False  # a new model: all
    assert configurator.given(configurator.parse(TrainConfig, [])) == set()
    assert configurator.given(TrainConfig(n_head=4, n_layer=12)) == {"n_head"}  # built in code: what differs
