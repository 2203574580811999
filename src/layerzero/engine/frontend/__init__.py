"""The front end: input processing (tokenize, validate: :class:`~.input_processor.InputProcessor`) and output
processing (incremental detokenization, stop strings, streaming deltas, logprobs:
:class:`~.output_processor.OutputProcessor`)."""
