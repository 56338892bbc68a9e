"""bench.py on tiny models: both modes run, read training config files, and report what they measured."""

import pytest

import bench
from conftest import ROOT
from configurator import UserError

TINY = ["--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16", "--device=cpu", "--warmup=1", "--repeats=2"]


def test_sample_mode_reports_both_paths_and_identical_greedy_tokens(capsys):
    rate, same = bench.main(["--mode=sample", "--vocab_size=65", "--max_new_tokens=20", "--prompt_len=3", *TINY])
    assert same and rate[True] > 0 and rate[False] > 0
    out = capsys.readouterr().out
    assert "vocab 65" in out and "greedy tokens identical: yes" in out
    assert out.count(" cached ") == 3 and out.count(" uncached ") == 3  # warm-up and two runs each


def test_train_mode_reads_a_training_config_file(capsys):
    median = bench.main([str(ROOT / "config/train_shakespeare_char.py"), "--mode=train", "--batch_size=2",
                         "--compile=False", *TINY])
    out = capsys.readouterr().out
    assert median > 0
    assert "1 micro-steps x batch 2 x 16 tokens = 32 tokens" in out  # gradient_accumulation_steps from the file
    assert out.count(" ms\n") == 3 and "median" in out and "tokens/s" in out


@pytest.mark.parametrize("arg,message", [("--mode=fast", "mode must be sample, train or speedrun, got 'fast'"),
                                         ("--prompt_len=17", "prompt_len .17. must be at most block_size")])
def test_bad_settings_are_one_line_errors(arg, message):
    with pytest.raises(UserError, match=message):
        bench.main([*TINY, arg])
