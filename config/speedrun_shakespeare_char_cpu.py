# CPU speedrun: val loss <= 1.88 on shakespeare_char (the whole val split) as fast as possible on 2 CPU cores.
# python prepare.py shakespeare_char && time python train.py config/speedrun_shakespeare_char_cpu.py
# Side by side with nanoGPT's CPU recipe through this train.py: python bench.py --mode=speedrun --repeats=3
#
# Each lever measured in docs/benchmarks-history.md ("CPU speedrun on any CPU"): Muon on the blocks' matrices (AdamW
# for embeddings and gains), which reaches in 500 steps what AdamW reaches in 1,400; QK-norm and Muon's
# momentum rising from 0.85 to 0.9 over the whole run, which take it there in 400; 3 Newton-Schulz steps
# with Polar Express's coefficients instead of 5 (40 % cheaper, as good); 2 layers instead of nanoGPT's 4
# (as good with Muon, half the cost); an MLP 3x wide instead of 4x, whose saving buys batches of 20
# instead of 16, which take it there in 340 steps; a schedule that ends with the run; one exact
# evaluation, at the end, over the whole val split; dtype=auto (bfloat16 only where the CPU computes it
# natively).

out_dir = "out-speedrun-shakespeare-char-cpu"
eval_interval = 100000  # never before the end
eval_at_start = False
eval_whole_val = True
eval_iters = 20  # batches for the train-loss figure of the final `step N:` line
log_interval = 100
always_save_checkpoint = False
ckpt_interval = 0

dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 20  # with mlp_ratio 3: as costly per step as 16 with 4x, and 340 steps instead of 400
block_size = 64

n_layer = 2
n_head = 4
n_embd = 128
dropout = 0.0
qk_norm = True  # normalised queries and keys: 1.8847 -> 1.8401 val loss at 400 steps
mlp_ratio = 3  # MLP 3x wide instead of 4x: 11-13 % less time per step

optimizer = "muon"
muon_lr = 0.025
muon_momentum = 0.9
muon_momentum_warmup = 340  # 0.85 -> 0.9 over the whole run (-> 0.95 over 250 of 400 steps: 1.8619)
muon_ns_steps = 3  # as good as 5 here (seeds 1337, 1-4: mean 1.861 vs 1.858), 40 % less Newton-Schulz work
learning_rate = 5e-3  # AdamW's (embeddings and gains)
max_iters = 340
lr_decay_iters = 340
min_lr = 5e-4
beta2 = 0.99
warmup_iters = 30

device = "cpu"
dtype = "auto"  # bfloat16 where the CPU computes it natively, else float32
compile = False
