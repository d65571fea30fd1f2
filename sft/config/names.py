"""Names a recipe value may take, shared by the config's fields and the command line's choices. Plain tuples with no
torch or transformers import, so `sft --help` and argument errors stay fast."""

DTYPE_NAMES = ("auto", "bfloat16", "float16", "float32")  # a weights dtype: auto keeps the checkpoint's
NO_ASSISTANT_TURN = ("error", "drop")  # chat rows without an assistant message: stop, or skip and count
HISTORY = ("split", "last", "error")  # templates that render earlier turns differently (chat.ChatRenderer)
DISTRIBUTED_PRESETS = ("ddp", "fsdp", "fsdp_offload", "zero2", "zero3", "zero3_offload")  # recipe key `distributed`
# what computes the trained-positions loss (sft.training.loss.TokenLoss)
LOSS_KERNELS = ("auto", "chunked", "fused", "liger")
CHUNKED_LOSS_KERNELS = ("fused", "liger")  # kernels that compute the chunked loss: they need chunked_loss: true
