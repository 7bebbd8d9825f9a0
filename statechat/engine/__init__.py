"""The inference engine: sequences, scheduler, pools, model runner and the glue (LLMEngine)."""
