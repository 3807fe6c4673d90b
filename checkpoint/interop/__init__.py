"""Weights in and out, in other tools' formats (docs/interop.md). What the model's tensors are called
in Hugging Face's Llama, their q/k row order and its config.json are the model's (model/hf.py).

  export.py          offline tensor reading, one tensor at a time; safetensors and Hugging Face exports
  hf_config.py       the config.json and generation_config.json an export writes (torch-free)
  safetensors_io.py  safetensors written tensor by tensor, read in slices (a DCP StorageReader)
  weight_source.py   what a model.init_from path holds, from its small files (torch-free)
  init_from.py       model.init_from: pretrained weights into a parallelised model at step 0
  model_shape.py     model=hf: the model keys filled from model.init_from's config.json (torch-free)
  from_hf.py         a Hugging Face folder as a committed step-0 checkpoint, streamed tensor by tensor
  convert.py         a raw checkpoint as stock DCP files
"""
