"""Layer 3 — data: recipe sources to tokenized examples with exact loss masks.

Owns: sources (files, folders, Hub ids, weights), formats and their renderers, chat rows and the chat-template
rule for which tokens are trained (`chat`, `chat_templates`: stop tokens are decided there), the tokenizer a recipe
names, encoding text spans to labels (`encode`, `seq2seq`), packing and the collators that keep packed examples
apart, example boundaries in a batch, dataset statistics, `sft data`'s report and mask view.
Must not import: sft.evaluation, sft.training, sft.planning, sft.check, sft.cli. It reads model facts (is the model
an encoder-decoder, where its tokenizer lives) from sft.models.
"""
