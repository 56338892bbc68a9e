# Finetune OpenAI's GPT-2 into an assistant on conversations: the loss on the assistant's tokens only.
# python prepare.py chat --input convs.jsonl --name mychat
# python train.py config/finetune_chat.py --dataset=mychat
# (on one GPU; a laptop CPU: the README's overrides, in "Chat: finetune a model into an assistant"). init_from takes
# any GPT-2 size or directory, as in finetune_shakespeare.py; the chat format's special tokens get rows of GPT-2's
# padded vocabulary.

out_dir = "out-chat"
eval_interval = 100
eval_iters = 40
wandb_log = False
wandb_project = "chat"
wandb_run_name = "sft-gpt2"

dataset = "chat"  # prepare.py chat's default --name
init_from = "gpt2"
# the weights fix the model; GPT-2 has biases, and saying so lets --init_from=resume continue this run
bias = True
chat_loss = "assistant"  # or "all": every token of the conversations
always_save_checkpoint = False  # ckpt.pt when the validation loss improves (and at the end)

# 8 conversations x 4 accumulation per iteration, each up to 1024 tokens (a row is a conversation, padded to the
# batch's longest); 1000 iterations = 32,000 conversations (a few epochs of a dataset of ~10k)
batch_size = 8
gradient_accumulation_steps = 4
block_size = 1024
max_iters = 1000
dropout = 0.1

# a small learning rate, warmed up, then a cosine down to a tenth
learning_rate = 3e-5
warmup_iters = 50
lr_decay_iters = 1000
min_lr = 3e-6
weight_decay = 0.0
