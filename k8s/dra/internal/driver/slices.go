// Package driver is the DRA driver gpu.devbroker.io: the devices a node's broker
// offers (this file), what a claim's allocation makes of a tenant (claim.go), and
// the kubelet's prepare/unprepare calls (plugin.go).
package driver

import (
	"fmt"
	"strconv"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/utils/ptr"

	"devbroker.io/k8s/dra/internal/broker"
)

// DriverName is the DRA driver's name and the domain of its attributes and capacities.
const DriverName = "gpu.devbroker.io"

// The consumable capacities of each GPU. Many claims share one GPU
// (allowMultipleAllocations); the scheduler keeps the sum of what they consume
// within each capacity.
const (
	// CapacityMemory is the GPU's memory in bytes; what a claim consumes becomes
	// its tenant's memory_quota on that GPU.
	CapacityMemory = "memory"
	// CapacityCompute is a GPU's time in ComputeUnits units; what a claim consumes
	// becomes its tenant's compute_weight (the broker's share of GPU time next to
	// other busy tenants, 1..64: docs/compute-shares.md), so the shares the
	// scheduler hands out add up to at most the whole GPU.
	CapacityCompute = "compute"
	ComputeUnits    = 64
)

var (
	memoryStep     = resource.MustParse("1Mi")
	memoryDefault  = resource.MustParse("1Gi")
	computeDefault = resource.MustParse("1")
)

// DeviceName is the device of GPU index in the node's pool.
func DeviceName(index int) string { return fmt.Sprintf("gpu-%d", index) }

// DeviceIndex is the GPU index of a device name, or an error for a name this
// driver never publishes.
func DeviceIndex(name string) (int, error) {
	digits, ok := strings.CutPrefix(name, "gpu-")
	if !ok {
		return 0, fmt.Errorf("device %q is not one of %s's (gpu-N)", name, DriverName)
	}
	n, err := strconv.Atoi(digits)
	if err != nil || n < 0 || strconv.Itoa(n) != digits {
		return 0, fmt.Errorf("device %q is not one of %s's (gpu-N)", name, DriverName)
	}
	return n, nil
}

// Devices are the ResourceSlice devices of a broker's GPUs.
func Devices(gpus []broker.GPU, backend string) []resourceapi.Device {
	devices := make([]resourceapi.Device, 0, len(gpus))
	for _, g := range gpus {
		memory := resource.NewQuantity(g.Memory, resource.BinarySI)
		memoryRange := &resourceapi.CapacityRequestPolicyRange{
			Min: ptr.To(memoryStep), Step: ptr.To(memoryStep)}
		def := memoryDefault
		if g.Memory < def.Value() {
			// a GPU smaller than the default request: a claim that does not say
			// takes all of it (still a multiple of the step)
			def = *resource.NewQuantity(g.Memory/memoryStep.Value()*memoryStep.Value(), resource.BinarySI)
		}
		devices = append(devices, resourceapi.Device{
			Name: DeviceName(g.Index),
			Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
				"index":       {IntValue: ptr.To(int64(g.Index))},
				"uuid":        {StringValue: ptr.To(g.UUID)},
				"productName": {StringValue: ptr.To(g.Name)},
				"pciBusID":    {StringValue: ptr.To(g.PCIBusID)},
				"backend":     {StringValue: ptr.To(backend)},
			},
			Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
				CapacityMemory: {
					Value: *memory,
					RequestPolicy: &resourceapi.CapacityRequestPolicy{
						Default:    ptr.To(def),
						ValidRange: memoryRange,
					},
				},
				CapacityCompute: {
					Value: *resource.NewQuantity(ComputeUnits, resource.DecimalSI),
					RequestPolicy: &resourceapi.CapacityRequestPolicy{
						Default: ptr.To(computeDefault),
						ValidRange: &resourceapi.CapacityRequestPolicyRange{
							Min:  ptr.To(computeDefault),
							Max:  resource.NewQuantity(ComputeUnits, resource.DecimalSI),
							Step: ptr.To(computeDefault),
						},
					},
				},
			},
			AllowMultipleAllocations: ptr.To(true),
		})
	}
	return devices
}
