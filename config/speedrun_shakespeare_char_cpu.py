# CPU speedrun: val loss <= 1.88 on shakespeare_char as fast as possible on 2 CPU cores
# (nanoGPT's CPU recipe takes 98 s to reach 1.886 on the same machine; figures in BENCHMARKS.md).
# python prepare.py shakespeare_char && time python train.py config/speedrun_shakespeare_char_cpu.py
#
# nanoGPT's model (4 layers, 128 wide, block 64, batch 12) with a 5x higher learning rate, a short
# warmup and a cosine schedule that ends with the run, bfloat16 matmuls and the fused AdamW. A single
# evaluation, at the end, over the whole val split (exact; no step-0 evaluation).

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
batch_size = 12
block_size = 64

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0

optimizer = "muon"  # Muon on the blocks' matrices, AdamW on embeddings and gains
muon_lr = 0.02
muon_momentum_warmup = 300
learning_rate = 5e-3  # AdamW's
max_iters = 600
lr_decay_iters = 600
min_lr = 5e-4
beta2 = 0.99
warmup_iters = 30

device = "cpu"
dtype = "auto"  # bfloat16 where the CPU computes it natively, else float32
compile = False
