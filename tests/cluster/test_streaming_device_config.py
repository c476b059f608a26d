"""`transfer.streaming: layer` needs a host page pool: the deploy config refuses it with `device: cuda` at
validation, naming the field and what to use instead, rather than a worker failing at start."""
import pytest

from pd.cluster.config import ConfigError, DeployConfig


def test_layer_streaming_on_cuda_is_refused_at_config_validation():
    with pytest.raises(ConfigError, match=r"transfer.streaming: 'layer' needs the KV pool in host memory .*"
                                          r"here topology.device is cuda \(use 'chunk' or 'off'\)"):
        DeployConfig.from_dict({"transfer": {"streaming": "layer"}, "topology": {"device": "cuda"}})
    # what stays accepted: layer streaming on the CPU, and the other modes on CUDA
    assert DeployConfig.from_dict({"transfer": {"streaming": "layer"}}).transfer.streaming == "layer"
    for mode in ("chunk", "off"):
        config = DeployConfig.from_dict({"transfer": {"streaming": mode}, "topology": {"device": "cuda"}})
        assert config.transfer.streaming == mode
