"""``deepspeed.compression``: DeepSpeed 0.19.8 removed its compression library and keeps this
package for :mod:`deepspeed.compression.helper`'s two module helpers, which code such as
DeepSpeed-Chat still imports. The library's modules (``compress``, ``basic_layer``, ...) are
refused with a message (``deepspeed.refused``)."""
from deepspeed.refused import module_getattr

__getattr__ = module_getattr(__name__)
