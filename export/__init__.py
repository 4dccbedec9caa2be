"""Export a trained drafter in the formats vLLM, SGLang, speculators and the Medusa repo load, with a model card;
push to the Hub."""
