# GPT-2 (124M) on OpenWebText, nanoGPT's recipe: ~2.85 val loss after 600k iterations.
# Tokens per iteration: 12 batch x 1024 block x 40 accumulation = 491,520 (about 0.5M).
# torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py
# (gradient_accumulation_steps counts micro-batches over all processes: 40 = 5 per GPU on 8 GPUs)

wandb_log = False
wandb_project = "owt"
wandb_run_name = "gpt2-124M"

dataset = "openwebtext"
batch_size = 12
block_size = 1024
gradient_accumulation_steps = 40

n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = False

learning_rate = 6e-4
max_iters = 600000
lr_decay_iters = 600000
min_lr = 6e-5
warmup_iters = 2000
weight_decay = 0.1

eval_interval = 1000
eval_iters = 200
log_interval = 10
