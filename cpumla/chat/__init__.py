"""Chat: conversation state (cache reuse across turns), chat formats of the DeepSeek families,
tokenizers (with the incremental detokenizer) and token sampling."""
