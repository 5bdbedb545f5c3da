"""A processed picture crosses processes by value: the render process sends it to the server, the
replica front to a replica through Ray. Pickled by multiprocessing's pickler, a torch tensor would go
by torch's shared-memory handoff instead (a file descriptor, a file in /dev/shm)."""
import pickle
import warnings
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch
from PIL import Image

from prefixserve.model.random_models import RANDOM_PRESETS
from prefixserve.multimodal.processor import process_image


def processed():
    pixels = np.random.default_rng(0).integers(0, 256, (150, 230, 3), dtype=np.uint8)
    return process_image(Image.fromarray(pixels), RANDOM_PRESETS["qwen2.5-vl-tiny"].vision)


def test_the_patches_travel_by_value_and_come_back_equal():
    image = processed()
    data = bytes(ForkingPickler.dumps(image))
    assert len(data) >= image.pixel_values.nbytes   # the bytes themselves, not a handle to them
    back = pickle.loads(data)
    assert torch.equal(back.pixel_values, image.pixel_values)
    assert (back.grid_thw, back.num_tokens) == (image.grid_thw, image.num_tokens)


def test_read_only_patches_become_a_writable_tensor():
    """Ray hands a numpy array over read-only: the tensor rebuilt from it owns writable memory."""
    image = processed()
    rebuild, args = image.__reduce__()
    pixels = args[0].copy()
    pixels.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # torch warns on a read-only array
        back = rebuild(pixels, *args[1:])
    back.pixel_values.add_(0)
    assert torch.equal(back.pixel_values, image.pixel_values)
