package driver

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"

	"devbroker.io/k8s/dra/internal/broker"
)

// Broker is what the plugin needs of the node's broker (broker.Client).
type Broker interface {
	TenantAdd(name string, spec map[string]any, labels map[string]string) (bool, error)
	TenantRm(name string, grace time.Duration) (bool, error)
}

// CDI writes and removes a tenant's CDI spec file.
type CDI interface {
	Write(tenant, path string) error
}

// DevbrokerCDI writes the spec with the broker's own `devbroker cdi`, so that the
// devices a pod gets are exactly those a runc or podman container of the same
// tenant gets (one source of truth: src/devbroker/oci/cdi.py).
type DevbrokerCDI struct {
	Devbroker string // the devbroker command
	RunDir    string
	Frontend  string // fuse or seccomp
}

func (c DevbrokerCDI) Write(tenant, path string) error {
	cmd := exec.Command(c.Devbroker, "--run-dir", c.RunDir, "cdi", "--frontend", c.Frontend,
		"--tenant", tenant, "-o", path)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("devbroker cdi --tenant %s: %v: %s", tenant, err, strings.TrimSpace(string(out)))
	}
	return nil
}

// Plugin implements kubeletplugin.DRAPlugin. It keeps no state of its own: a
// claim's tenant is named by the claim's UID, the broker keeps the tenants
// (across its restarts and live upgrades), and the CDI spec files are named by
// the tenant, so a restarted plugin prepares and unprepares exactly as before.
type Plugin struct {
	NodeName string
	Broker   Broker
	CDI      CDI
	CDIDir   string
	Kube     kubernetes.Interface // for the pod's container names (a label); may be nil
	GPUs     map[int]broker.GPU
	// Grace is how long a removed tenant's processes get between SIGTERM and SIGKILL.
	Grace  time.Duration
	Cancel context.CancelCauseFunc // stops the plugin on a fatal background error
}

var _ kubeletplugin.DRAPlugin = (*Plugin)(nil)

// CDISpecPath is the file holding a tenant's CDI spec.
func (p *Plugin) CDISpecPath(tenant string) string {
	return filepath.Join(p.CDIDir, DriverName+"-"+tenant+".json")
}

func (p *Plugin) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	result := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, claim := range claims {
		devices, err := p.prepare(ctx, claim)
		result[claim.UID] = kubeletplugin.PrepareResult{Devices: devices, Err: err}
	}
	return result, nil
}

func (p *Plugin) prepare(ctx context.Context, claim *resourceapi.ResourceClaim) ([]kubeletplugin.Device, error) {
	plan, err := PlanFor(claim, p.NodeName, p.GPUs)
	if err != nil || plan == nil {
		return nil, err
	}
	if plan.Labels["container"], err = p.containers(ctx, claim); err != nil {
		return nil, err
	}
	existed, err := p.Broker.TenantAdd(plan.Tenant, plan.Spec, plan.Labels)
	if err != nil {
		return nil, err
	}
	if err := p.CDI.Write(plan.Tenant, p.CDISpecPath(plan.Tenant)); err != nil {
		return nil, err
	}
	klog.FromContext(ctx).Info("claim prepared", "claim", klog.KObj(claim), "tenant", plan.Tenant,
		"spec", plan.Spec, "existed", existed)
	return plan.Devices, nil
}

// containers names the containers of the claim's pods that use it (a label). An
// API error fails the prepare (the kubelet retries): a label that depended on
// the API's mood would make a repeated prepare ask for another tenant spec.
func (p *Plugin) containers(ctx context.Context, claim *resourceapi.ResourceClaim) (string, error) {
	if p.Kube == nil {
		return "", nil
	}
	var names []string
	for _, ref := range claim.Status.ReservedFor {
		if ref.Resource != "pods" {
			continue
		}
		pod, err := p.Kube.CoreV1().Pods(claim.Namespace).Get(ctx, ref.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) || (err == nil && pod.UID != ref.UID) {
			continue // gone for good: it runs nothing here
		}
		if err != nil {
			return "", fmt.Errorf("pod %s/%s: %w", claim.Namespace, ref.Name, err)
		}
		names = append(names, ContainersUsing(pod, claim.Name)...)
	}
	sort.Strings(names)
	return strings.Join(names, ","), nil
}

// ContainersUsing lists the containers of pod that use the ResourceClaim named
// claimName (directly, or made for the pod from a template).
func ContainersUsing(pod *corev1.Pod, claimName string) []string {
	entries := map[string]bool{}
	for _, rc := range pod.Spec.ResourceClaims {
		if rc.ResourceClaimName != nil && *rc.ResourceClaimName == claimName {
			entries[rc.Name] = true
		}
	}
	for _, st := range pod.Status.ResourceClaimStatuses {
		if st.ResourceClaimName != nil && *st.ResourceClaimName == claimName {
			entries[st.Name] = true
		}
	}
	var names []string
	for _, list := range [][]corev1.Container{pod.Spec.InitContainers, pod.Spec.Containers} {
		for _, c := range list {
			for _, rc := range c.Resources.Claims {
				if entries[rc.Name] {
					names = append(names, c.Name)
					break
				}
			}
		}
	}
	return names
}

func (p *Plugin) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	result := make(map[types.UID]error, len(claims))
	for _, claim := range claims {
		result[claim.UID] = p.unprepare(ctx, claim)
	}
	return result, nil
}

// unprepare removes the claim's tenant (the broker ends what is left of its
// processes, frees its memory, and answers once it is gone), then its CDI spec.
// Either already gone is fine: the kubelet may ask again.
func (p *Plugin) unprepare(ctx context.Context, claim kubeletplugin.NamespacedObject) error {
	tenant, err := TenantName(claim.UID)
	if err != nil {
		return err
	}
	existed, err := p.Broker.TenantRm(tenant, p.Grace)
	if err != nil {
		return err
	}
	if err := os.Remove(p.CDISpecPath(tenant)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	klog.FromContext(ctx).Info("claim unprepared", "claim", claim, "tenant", tenant, "existed", existed)
	return nil
}

func (p *Plugin) HandleError(ctx context.Context, err error, msg string) {
	klog.FromContext(ctx).Error(err, msg)
	if !errors.Is(err, kubeletplugin.ErrRecoverable) && p.Cancel != nil {
		p.Cancel(fmt.Errorf("fatal: %s: %w", msg, err))
	}
}

func (p *Plugin) WatchHealthStatus(ctx context.Context, reports chan<- kubeletplugin.DeviceHealthReport) error {
	return kubeletplugin.ErrHealthNotSupported
}
