from conftest import run, tiny_train_args


def test_train_then_sample(tmp_path, char_data):
    out = tmp_path / "out"
    proc = run("train.py", *tiny_train_args(char_data, out), check=True)
    assert "step 20: train loss" in proc.stdout
    assert (out / "ckpt.pt").is_file() and (out / "best.pt").is_file()
    sample = run("sample.py", f"--out_dir={out}", "--num_samples=2", "--max_new_tokens=20", "--device=cpu",
                 check=True)
    assert sample.stdout.count("---------------") == 2
