"""The plugin manager: discovery, duplicate and unknown names, blocking, tracing, bad hooks."""
import attrs
import pytest

import zkit
from zkit.core.plugin_manager import PluginError, get_plugin_manager
from zkit.core.config import ConfigError, load_config
from zkit.core.records import FAMILIES, ConfigSectionRecord, OptimizerRecord, ProviderRecord, SchedulerRecord
from zkit.core.stack import Stack, merge_plugin_stacks


def _opt_plugin(name, label):
    class Plugin:
        __module__ = label  # the manager names a plugin's distribution after its module

        @zkit.hookimpl
        def zkit_register_optimizers(self):
            yield OptimizerRecord(name=name, factory=lambda groups, **kw: None)

    return Plugin()


def test_builtins_cover_all_six_families():
    pm = get_plugin_manager(autoload=False)
    for family in FAMILIES:
        assert pm.records(family), family
    assert pm.lookup("partitioner", "ZeRO1").stage == 1
    assert pm.lookup("optimizer", "ADAMW").dist == "zkit"


def test_duplicate_name_names_both_distributions():
    pm = get_plugin_manager(autoload=False, extra_plugins=[_opt_plugin("adam", "acme_optim")])
    with pytest.raises(PluginError, match=r"two optimizer records are named 'adam': one from 'zkit', one from 'acme_optim'"):
        pm.records("optimizer")


def test_unknown_name_lists_valid_ones_and_the_closest():
    pm = get_plugin_manager(autoload=False)
    with pytest.raises(PluginError, match=r"unknown optimizer 'adamm'; valid optimizer names: .*adam, adamw.*Did you mean 'adam'\?"):
        pm.lookup("optimizer", "adamm")


def test_unknown_name_of_a_known_distribution_says_what_to_install():
    pm = get_plugin_manager(autoload=False)
    with pytest.raises(PluginError, match=r"provided by the distribution 'zkit-onebit': pip install zkit-onebit"):
        pm.lookup("optimizer", "OneBitAdam")


def _provider_plugin(label, *records):
    class Plugin:
        __module__ = label

        @zkit.hookimpl
        def zkit_register_providers(self):
            yield from records

    return Plugin()


def test_an_installed_distribution_names_what_to_install_for_another_the_kernel_knows_nothing_of():
    """The kernel holds no catalogue: a distribution that is installed declares which one provides
    a name, and the unknown name and the config key then say what to install."""
    acme = _provider_plugin("acme_base", ProviderRecord(kind="optimizer", name="AcmeAdam", provider="acme-kernels"),
                            ProviderRecord(kind="config", name="acme", provider="acme-kernels"))
    pm = get_plugin_manager(autoload=False, extra_plugins=[acme])
    assert pm.provider("optimizer", "acmeadam").dist == "acme_base"
    with pytest.raises(PluginError, match=r"optimizer 'AcmeAdam' is provided by the distribution 'acme-kernels': "
                                          r"pip install acme-kernels$"):
        pm.lookup("optimizer", "AcmeAdam")
    with pytest.raises(ConfigError, match=r"config key 'acme' is provided by the distribution 'acme-kernels', which "
                                          r"is not installed: pip install acme-kernels"):
        load_config({"train_batch_size": 1, "acme": {"x": 1}}, world_size=1, sections=pm.config_sections(),
                    providers=pm.config_providers())
    assert load_config({"train_batch_size": 1, "acme": None}, world_size=1, sections=pm.config_sections(),
                       providers=pm.config_providers()).train_batch_size == 1


def test_two_distributions_naming_the_provider_of_one_name_are_refused_naming_both():
    pm = get_plugin_manager(autoload=False, extra_plugins=[
        _provider_plugin("acme_base", ProviderRecord(kind="optimizer", name="cpu_adam", provider="acme-kernels"))])
    with pytest.raises(PluginError, match=r"two provider records are named 'optimizer cpu_adam': one from 'zkit', "
                                          r"one from 'acme_base'"):
        pm.lookup("optimizer", "nothing")


def test_a_plugin_slot_of_a_built_in_section_that_nothing_fills_takes_only_null(monkeypatch):
    """zero_optimization's offload keys are slots for a plugin's sections: with neither a section
    nor a record naming the distribution, a value that asks for something is refused, not kept."""
    pm = get_plugin_manager(autoload=False, blocked=["zkit.distributions"])
    assert not pm.config_providers()
    base = {"train_batch_size": 1, "zero_optimization": {"stage": 2, "offload_optimizer": None}}
    load_config(base, world_size=1, sections=pm.config_sections(), providers=pm.config_providers())
    with pytest.raises(ConfigError, match=r"config key 'zero_optimization.offload_optimizer' \(device 'cpu'\) is "
                                          r"filled by a plugin's section, and no installed plugin registers one"):
        load_config({**base, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
                    world_size=1, sections=pm.config_sections(), providers=pm.config_providers())


def test_blocking_a_builtin_removes_its_records():
    pm = get_plugin_manager(autoload=False, blocked=["zkit.optim_torch"])
    with pytest.raises(PluginError, match="unknown optimizer 'adam'"):
        pm.lookup("optimizer", "adam")


def test_blocking_through_the_environment(monkeypatch):
    monkeypatch.setenv("ZKIT_BLOCK_PLUGINS", "zkit.lr_schedules")
    pm = get_plugin_manager(autoload=False)
    assert not pm.records("scheduler") or "warmuplr" not in pm.records("scheduler")


def test_misspelled_hook_fails_loudly():
    class Typo:
        @zkit.hookimpl
        def zkit_register_optimisers(self):
            return []

    with pytest.raises(PluginError, match="zkit_register_optimisers"):
        get_plugin_manager(autoload=False, extra_plugins=[Typo()])


def test_wrong_record_type_is_named():
    class Wrong:
        @zkit.hookimpl
        def zkit_register_optimizers(self):
            yield SchedulerRecord(name="x", factory=object)

    pm = get_plugin_manager(autoload=False, extra_plugins=[Wrong()])
    with pytest.raises(PluginError, match=r"expected a zkit.core.records.OptimizerRecord \(optimizer\)"):
        pm.records("optimizer")



def test_config_section_records_are_checked_like_every_other_record():
    @attrs.frozen
    class Section:
        size: int = 1

    def plugin(module, record):
        class Plugin:
            __module__ = module

            @zkit.hookimpl
            def zkit_config_sections(self):
                yield record

        return Plugin()

    one, two = (plugin(m, ConfigSectionRecord(path="shared_section", schema=Section)) for m in ("acme_a", "acme_b"))
    pm = get_plugin_manager(autoload=False, extra_plugins=[one, two])
    with pytest.raises(PluginError, match=r"two config section records are named 'shared_section': one from "
                                          r"'acme_a', one from 'acme_b'"):
        pm.config_sections()
    pm = get_plugin_manager(autoload=False, extra_plugins=[plugin("acme_c", {"path": "x"})])
    with pytest.raises(PluginError, match=r"zkit_config_sections of distribution 'acme_c' yielded \{'path': 'x'\}; "
                                          r"expected a zkit.core.records.ConfigSectionRecord \(config section\)"):
        pm.config_sections()

def test_trace_logs_hook_calls(monkeypatch, capsys):
    monkeypatch.setenv("ZKIT_TRACE", "1")
    pm = get_plugin_manager(autoload=False)
    pm.hook.zkit_report()
    assert "[zkit trace]" in capsys.readouterr().err


def test_stack_overrides_and_validates():
    a = Stack(partitioner="zero1", optimizer="adam")
    b = a | Stack(optimizer="sgd")
    assert (b.partitioner, b.optimizer) == ("zero1", "sgd")
    with pytest.raises(TypeError, match=r"Stack\(optimizer=...\) takes a optimizer name or a OptimizerRecord"):
        Stack(optimizer=42)


def test_two_plugins_choosing_different_records_is_an_error():
    with pytest.raises(ValueError, match=r"plugins 'a' and 'b' both choose the allocator: 'host' vs 'nvme'"):
        merge_plugin_stacks([("a", Stack(allocator="host")), ("b", Stack(allocator="nvme"))])
    merged = merge_plugin_stacks([("a", Stack(allocator="host")), ("b", Stack(allocator="HOST", optimizer="x"))])
    assert (merged.allocator, merged.optimizer) == ("HOST", "x")


def test_record_names_are_validated():
    with pytest.raises(ValueError, match="a record name must be a non-empty string"):
        OptimizerRecord(name=" ", factory=object)
    with pytest.raises(ValueError, match="'kind' must be in"):
        SchedulerRecord(name="x", factory=object, kind="weird")



REGISTRATION_HOOKS = sorted(n for n in dir(zkit.core.hookspecs) if n.startswith("zkit_register_")) + ["zkit_config_sections"]


def test_registration_hooks_are_called_through_pluggy():
    """A plugin registered at runtime is reached through the manager's hook caller: a wrapper of
    every registration hook sees each plugin's answer, and pluggy's call monitoring sees each call
    with the plugin's implementation (a plain call of the implementation bypasses both)."""
    import attrs

    wrapped, monitored = [], []

    @attrs.frozen
    class Section:
        size: int = 1

    class ThirdParty:
        __module__ = "third_party"

        @zkit.hookimpl
        def zkit_register_optimizers(self):
            yield OptimizerRecord(name="runtime_opt", factory=lambda groups, **kw: None)

        @zkit.hookimpl
        def zkit_config_sections(self):
            yield ConfigSectionRecord(path="runtime_section", schema=Section)

    class Wrapper:
        __module__ = "third_party_wrapper"

    def wrap(hook_name):
        @zkit.hookimpl(wrapper=True)
        def wrapper(self):
            answers = yield
            wrapped.append((hook_name, len(answers)))
            return answers

        return wrapper

    for hook_name in REGISTRATION_HOOKS:
        setattr(Wrapper, hook_name, wrap(hook_name))
    third_party, wrapper = ThirdParty(), Wrapper()
    pm = get_plugin_manager(autoload=False, extra_plugins=[third_party, wrapper])
    pm.add_hookcall_monitoring(lambda name, impls, kwargs: monitored.append((name, [i.plugin for i in impls])),
                               lambda outcome, name, impls, kwargs: None)
    assert pm.lookup("optimizer", "runtime_opt").dist == "third_party"
    assert pm.config_sections()["runtime_section"].dist == "third_party"
    for family in FAMILIES:
        pm.records(family)
    pm.checkpoint_formats()
    pm.providers()
    assert {name for name, _ in wrapped} == set(REGISTRATION_HOOKS)
    assert all(count == 1 for _, count in wrapped)  # one call per answering plugin, each wrapped
    for hook_name in ("zkit_register_optimizers", "zkit_config_sections"):
        assert (hook_name, [third_party, wrapper]) in monitored


def test_a_user_stack_overriding_the_allocator_a_plugin_needs_is_refused_with_the_plugin_s_reason():
    """The kernel's rule names no distribution: the plugin's stack says why it chose the allocator."""
    from zkit.core.stack import configure

    class Needy:
        __module__ = "acme_memory"

        @zkit.hookimpl
        def zkit_configure(self, config):
            return Stack(allocator="flat", reason="acme.pool asks for pooled buffers")

    pm = get_plugin_manager(autoload=False, extra_plugins=[Needy()])
    config = load_config({"train_batch_size": 1}, world_size=1, sections=pm.config_sections())
    with pytest.raises(ValueError, match=r"the config needs allocator 'flat' \(chosen by plugin '.*' for what the "
                                         r"config asks: acme.pool asks for pooled buffers\), but "
                                         r"zkit.Stack\(allocator='other'\) chooses another"):
        configure(pm, Stack(allocator="other"), config)
