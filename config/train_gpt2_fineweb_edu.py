# GPT-2 (124M) on 10B tokens of FineWeb-Edu, build-nanogpt's recipe (one epoch of sample-10BT).
# python prepare.py fineweb_edu
# torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2_fineweb_edu.py
# Tokens per step: 16 sequences x 1024 tokens x 32 micro-batches = 524,288 (2**19), on any number of GPUs
# (gradient_accumulation_steps counts micro-batches over all processes: 4 per GPU on 8 GPUs).

out_dir = "out-gpt2-fineweb-edu"
wandb_log = False
wandb_project = "fineweb-edu"
wandb_run_name = "gpt2-124M"

dataset = "fineweb_edu"
batch_size = 16
block_size = 1024
gradient_accumulation_steps = 32

n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = False

learning_rate = 6e-4
max_iters = 19073  # 10e9 tokens / 524,288 per step
lr_decay_iters = 19073
min_lr = 6e-5
warmup_iters = 715
weight_decay = 0.1
beta2 = 0.95

eval_interval = 250
eval_iters = 40  # batches per split per evaluation, shared by the GPUs: 655,360 val tokens
hellaswag_interval = 250  # HellaSwag acc_norm with every evaluation, as build-nanogpt (downloads the val split once)
log_interval = 10
ckpt_interval = 1000
