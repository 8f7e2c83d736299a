package driver

import (
	"testing"

	"devbroker.io/k8s/dra/internal/broker"
)

func TestDeviceNamesRoundTrip(t *testing.T) {
	for _, i := range []int{0, 1, 7, 12} {
		if got, err := DeviceIndex(DeviceName(i)); err != nil || got != i {
			t.Errorf("%d -> %q -> %d, %v", i, DeviceName(i), got, err)
		}
	}
	for _, bad := range []string{"gpu-", "gpu--1", "gpu-01", "gpu-1x", "nic-0", "gpu-+1"} {
		if _, err := DeviceIndex(bad); err == nil {
			t.Errorf("DeviceIndex(%q): want an error", bad)
		}
	}
}

func TestDevicesShareMemoryAndComputeByRequestPolicy(t *testing.T) {
	devices := Devices([]broker.GPU{
		{Index: 0, Name: "NVIDIA H200", UUID: "GPU-a", PCIBusID: "0000:00:06.0", Memory: 32 * GiB},
		{Index: 1, Name: "small", UUID: "GPU-b", PCIBusID: "0000:00:07.0", Memory: 512 << 20},
	}, "emulated")
	if len(devices) != 2 || devices[0].Name != "gpu-0" || devices[1].Name != "gpu-1" {
		t.Fatalf("devices %v", devices)
	}
	d := devices[0]
	if !*d.AllowMultipleAllocations || *d.Attributes["uuid"].StringValue != "GPU-a" ||
		*d.Attributes["index"].IntValue != 0 || *d.Attributes["productName"].StringValue != "NVIDIA H200" {
		t.Errorf("device %+v", d)
	}
	mem := d.Capacity[CapacityMemory]
	if mem.Value.Value() != 32*GiB || mem.RequestPolicy.Default.Value() != GiB ||
		mem.RequestPolicy.ValidRange.Step.Value() != 1<<20 {
		t.Errorf("memory %+v", mem)
	}
	cmp := d.Capacity[CapacityCompute]
	if cmp.Value.Value() != ComputeUnits || cmp.RequestPolicy.ValidRange.Max.Value() != ComputeUnits ||
		cmp.RequestPolicy.Default.Value() != 1 {
		t.Errorf("compute %+v", cmp)
	}
	// a GPU smaller than the default request: the default is the whole GPU
	if got := devices[1].Capacity[CapacityMemory].RequestPolicy.Default.Value(); got != 512<<20 {
		t.Errorf("small GPU's default %d", got)
	}
}
