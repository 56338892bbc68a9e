# Finetune OpenAI's GPT-2 on Tiny Shakespeare in GPT-2 BPE (nanoGPT's recipe).
# python prepare.py shakespeare && python train.py config/finetune_shakespeare.py
# init_from takes gpt2, gpt2-medium, gpt2-large, gpt2-xl (from the local Hugging Face cache)
# or the path of a Hugging Face GPT-2 directory (config.json + model.safetensors).

out_dir = "out-shakespeare"
eval_interval = 5
eval_iters = 40
wandb_log = False
wandb_project = "shakespeare"
wandb_run_name = "ft-gpt2"

dataset = "shakespeare"
init_from = "gpt2"
# the weights fix the model; GPT-2 has biases, and saying so lets --init_from=resume continue this run
bias = True

# only save checkpoints if the validation loss improves
always_save_checkpoint = False

# 1 batch x 32 accumulation x 1024 tokens = 32,768 tokens per iteration;
# Shakespeare has 301,966 tokens, so 1 epoch ~= 9.2 iterations
batch_size = 1
gradient_accumulation_steps = 32
max_iters = 20

# finetune at a constant, small learning rate
learning_rate = 3e-5
decay_lr = False
min_lr = 3e-6  # unused without decay, but train.py checks that it is below learning_rate
