# GPU speedrun: nanoGPT's GPU recipe (config/train_shakespeare_char.py: val 1.4697 after 5,000 steps,
# about 3 minutes on an A100) with the CPU speedrun's levers, to reach val <= 1.47 in fewer steps.
# python prepare.py shakespeare_char && python train.py config/speedrun_shakespeare_char_gpu.py
# Side by side with nanoGPT's recipe, through our train.py and nanoGPT's own (BENCHMARKS.md, *GPU*):
#   python bench.py --mode=speedrun --recipe=gpu --repeats=3 [--nanogpt=../nanoGPT/train.py]
#
# Tuned for wall time on an H200 (BENCHMARKS.md, *GPU speedrun*): 1,500 steps, uncompiled. torch.compile makes
# a step 7.0 ms instead of 11.3 (both one CUDA graph a step), but costs ~25 s before the first step and ~17 s
# more at the final evaluation (its shapes), more than it saves in 1,500 steps.
#
# The levers: Muon on the blocks' matrices (AdamW for embeddings and gains), a schedule that ends with
# the run, no evaluation before the end and one exact evaluation over the whole val split, the step as
# one CUDA graph and bfloat16 (train.py's defaults on CUDA).

out_dir = "out-speedrun-shakespeare-char-gpu"
eval_interval = 100000  # never before the end
eval_at_start = False
eval_whole_val = True
eval_iters = 20  # batches for the train-loss figure of the final `step N:` line
log_interval = 100
always_save_checkpoint = False
ckpt_interval = 0

dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 64
block_size = 256

n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2  # as nanoGPT's: this model overfits Tiny Shakespeare without it
qk_norm = True  # as the CPU speedrun (there: 1.8847 -> 1.8401 val loss at 400 steps)

optimizer = "muon"
muon_lr = 0.02
learning_rate = 1e-3  # AdamW's (embeddings and gains): nanoGPT's rate for this model
max_iters = 1500
lr_decay_iters = 1500
compile = False  # (see above)
min_lr = 1e-4
beta2 = 0.99
warmup_iters = 50
