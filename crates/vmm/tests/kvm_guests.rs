//! Tiny purpose-built guests on this host's /dev/kvm: real mode, 32-bit
//! protected mode and long mode, hand-assembled. They exercise the exit
//! loop (port I/O, MMIO), halting with interrupts delivered through the
//! in-kernel IOAPIC by an irqfd, and a triple fault ending the VM cleanly.
//!
//! The guests avoid `int3`: this project's development hosts run a
//! paravirtual nested KVM whose emulator cannot handle it.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use moat_vmm::VmExit;
use moat_vmm::arch::x86_64::layout::BOOT_TIMER_ADDR;
use moat_vmm::arch::x86_64::regs::{self, EntryPoint};
use moat_vmm::devices::boot_timer::{BootTimer, READY_MAGIC};
use moat_vmm::devices::bus::{Bus, BusDevice};
use moat_vmm::vstate::memory::create_guest_memory;
use moat_vmm::vstate::vcpu::{StartGate, Target, Vcpu, VcpuEvent, VcpuShared};
use moat_vmm::vstate::vm::Vm;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

const CODE: u64 = 0x1000;
const PORT: u64 = 0x3f8;

/// Collects what the guest writes to its port.
#[derive(Default, Clone)]
struct Output(Arc<Mutex<Vec<u8>>>);

impl Output {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("not poisoned")).into_owned()
    }

    /// Waits (bounded, generously: this is a liveness check, not a timing
    /// one) until the guest has written `want`.
    fn wait_for(&self, want: &str) -> bool {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if self.text().contains(want) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        false
    }
}

impl BusDevice for Output {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }
    fn write(&mut self, _offset: u64, data: &[u8]) {
        self.0.lock().expect("not poisoned").extend_from_slice(data);
    }
}

struct Machine {
    vm: Vm,
    out: Output,
    io: Arc<Bus>,
    mmio: Arc<Bus>,
    ready: moat_vmm::devices::boot_timer::BootReady,
}

fn machine(code: &[u8]) -> Machine {
    let vm = Vm::new(create_guest_memory(16 << 20).expect("guest memory")).expect("KVM VM on /dev/kvm");
    vm.memory().write_slice(code, GuestAddress(CODE)).expect("code fits");
    let out = Output::default();
    let mut io = Bus::default();
    io.insert(Arc::new(Mutex::new(out.clone())), PORT, 8).expect("free port");
    let (timer, ready) = BootTimer::new(Instant::now());
    let mut mmio = Bus::default();
    mmio.insert(Arc::new(Mutex::new(timer)), BOOT_TIMER_ADDR, 0x1000).expect("free window");
    Machine { vm, out, io: Arc::new(io), mmio: Arc::new(mmio), ready }
}

impl Machine {
    fn vcpu(&self) -> Vcpu {
        Vcpu::new(&self.vm, 0, self.io.clone(), self.mmio.clone()).expect("vCPU")
    }
}

fn run_to_exit(vcpu: &mut Vcpu) -> VmExit {
    for _ in 0..10_000 {
        match vcpu.run_once() {
            VcpuEvent::Continue | VcpuEvent::Interrupted => {}
            VcpuEvent::Exit(why) => return why,
        }
    }
    let regs = vcpu.fd().get_regs().expect("regs");
    panic!("the guest did not stop within 10000 exits; RIP {:#x}", regs.rip);
}

fn real_mode(vcpu: &Vcpu) {
    let mut sregs = vcpu.fd().get_sregs().expect("sregs");
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    vcpu.fd().set_sregs(&sregs).expect("sregs");
    let regs = kvm_bindings::kvm_regs { rip: CODE, rflags: 2, ..Default::default() };
    vcpu.fd().set_regs(&regs).expect("regs");
}

fn boot_mode(m: &Machine, vcpu: &Vcpu, entry: EntryPoint) {
    regs::write_boot_tables(m.vm.memory()).expect("boot tables");
    let sregs = vcpu.fd().get_sregs().expect("sregs");
    vcpu.fd().set_sregs(&regs::boot_sregs(sregs, entry)).expect("sregs");
    vcpu.fd().set_regs(&regs::boot_regs(entry)).expect("regs");
}

#[test]
#[ignore = "needs /dev/kvm; cargo xtask test provides it"]
fn real_mode_guest_writes_to_the_serial_port() {
    #[rustfmt::skip]
    let code = [
        0xba, 0xf8, 0x03,       // mov dx, 0x3f8
        0xb0, b'h', 0xee,       // mov al, 'h'; out dx, al
        0xb0, b'i', 0xee,       // mov al, 'i'; out dx, al
        0xeb, 0xfe,             // jmp $
    ];
    let m = machine(&code);
    let mut vcpu = m.vcpu();
    real_mode(&vcpu);
    for _ in 0..2 {
        assert_eq!(vcpu.run_once(), VcpuEvent::Continue);
    }
    assert_eq!(m.out.text(), "hi");
    let regs = vcpu.fd().get_regs().expect("regs");
    assert_eq!(regs.rip, CODE + 9, "stopped right after the second OUT");
}

#[test]
#[ignore = "needs /dev/kvm; cargo xtask test provides it"]
fn long_mode_guest_reports_ready_to_the_boot_timer() {
    // The boot tables map the first GiB; map 3–4 GiB (the MMIO hole) too.
    const PD_HOLE: u64 = 0xc000;
    #[rustfmt::skip]
    let mut code = vec![
        0x66, 0xba, 0xf8, 0x03, // mov dx, 0x3f8
        0xb0, b'6', 0xee,       // mov al, '6'; out dx, al
        0xb0, b'4', 0xee,       // mov al, '4'; out dx, al
        0x48, 0xb8,             // mov rax, BOOT_TIMER_ADDR
    ];
    code.extend_from_slice(&BOOT_TIMER_ADDR.to_le_bytes());
    code.extend_from_slice(&[0xc6, 0x00, READY_MAGIC]); // mov byte [rax], 123
    code.extend_from_slice(&[0x48, 0xb8]); // mov rax, 0x2000 (a zero IDTR)
    code.extend_from_slice(&0x2000u64.to_le_bytes());
    code.extend_from_slice(&[0x0f, 0x01, 0x18, 0x0f, 0x0b]); // lidt [rax]; ud2
    let m = machine(&code);
    let mem = m.vm.memory();
    let mut vcpu = m.vcpu();
    boot_mode(&m, &vcpu, EntryPoint::Linux64 { entry: CODE, zero_page: 0 });
    let pdpt = moat_vmm::arch::x86_64::layout::PDPT_ADDR;
    mem.write_obj(PD_HOLE | 3, GuestAddress(pdpt + 3 * 8)).expect("PDPT entry");
    for i in 0..512u64 {
        mem.write_obj((0xc000_0000 + (i << 21)) | 0x83, GuestAddress(PD_HOLE + i * 8)).expect("PD entry");
    }
    mem.write_slice(&[0u8; 10], GuestAddress(0x2000)).expect("IDTR fits");
    assert_eq!(run_to_exit(&mut vcpu), VmExit::Reset("triple fault"));
    assert_eq!(m.out.text(), "64");
    assert!(m.ready.micros().is_some(), "the boot timer saw the ready write");
}

#[test]
#[ignore = "needs /dev/kvm; cargo xtask test provides it"]
fn halted_guest_wakes_for_an_ioapic_interrupt_from_an_irqfd() {
    const GSI: u32 = 10;
    const VECTOR: u8 = 0x30;
    const IDT: u64 = 0x3000;
    const IDTR: u64 = 0x2000;
    let handler = CODE + 0x100;
    let mov = |addr: u32, value: u32| {
        let mut b = vec![0xc7, 0x05];
        b.extend_from_slice(&addr.to_le_bytes());
        b.extend_from_slice(&value.to_le_bytes());
        b
    };
    // Mask the 8259s first, as Linux does: the same GSI also reaches the
    // in-kernel PIC, whose unprogrammed vectors would arrive through LINT0.
    let mut code = vec![0xb0, 0xff, 0xe6, 0x21, 0xe6, 0xa1]; // mov al, 0xff; out 0x21, al; out 0xa1, al
    let pin = 0x10 + 2 * GSI;
    code.extend(mov(0xfec0_0000, pin)); // IOREGSEL: redirection entry, low
    code.extend(mov(0xfec0_0010, u32::from(VECTOR))); // fixed, edge, unmasked
    code.extend(mov(0xfec0_0000, pin + 1)); // high: destination APIC 0
    code.extend(mov(0xfec0_0010, 0));
    code.extend(mov(0xfee0_00f0, 0x1ff)); // LAPIC software enable
    code.extend_from_slice(&[0x0f, 0x01, 0x1d]); // lidt [IDTR]
    code.extend_from_slice(&u32::try_from(IDTR).expect("low").to_le_bytes());
    code.extend_from_slice(&[0x66, 0xba, 0xf8, 0x03, 0xb0, b'R', 0xee]); // say ready
    code.extend_from_slice(&[0xfb]); // sti
    code.extend_from_slice(&[0xf4, 0xeb, 0xfd]); // 1: hlt; jmp 1b
    code.resize(0x100, 0x90);
    code.extend_from_slice(&[0x66, 0xba, 0xf8, 0x03, 0xb0, b'I', 0xee]); // say interrupted
    code.extend(mov(0xfee0_00b0, 0)); // EOI
    // Halt again right here rather than `iretd`, which this project's
    // paravirtual development KVM cannot emulate; each interrupt costs 12
    // bytes of stack.
    code.extend_from_slice(&[0xfb, 0xf4, 0xeb, 0xfd]); // sti; 1: hlt; jmp 1b
    let m = machine(&code);
    let mem = m.vm.memory();
    let handler = u32::try_from(handler).expect("low");
    let gate: u64 = u64::from(handler & 0xffff) | (0x08 << 16) | (0x8e00u64 << 32) | (u64::from(handler >> 16) << 48);
    mem.write_obj(gate, GuestAddress(IDT + u64::from(VECTOR) * 8)).expect("gate");
    let mut idtr = (u16::from(VECTOR) * 8 + 7).to_le_bytes().to_vec();
    idtr.extend_from_slice(&u32::try_from(IDT).expect("low").to_le_bytes());
    mem.write_slice(&idtr, GuestAddress(IDTR)).expect("IDTR");
    let irq = EventFd::new(libc::EFD_NONBLOCK).expect("eventfd");
    m.vm.register_irq(&irq, GSI).expect("irqfd");
    let vcpu = m.vcpu();
    boot_mode(&m, &vcpu, EntryPoint::Pvh { entry: CODE, start_info: 0 });
    let mut regs = vcpu.fd().get_regs().expect("regs");
    regs.rsp = 0x8000; // the interrupt frame goes here
    vcpu.fd().set_regs(&regs).expect("regs");
    let shared = VcpuShared::new().expect("shared state");
    let start = StartGate::new();
    let handle = vcpu.start(shared.clone(), None, start.clone()).expect("vCPU thread");
    start.open(true);
    assert!(m.out.wait_for("R"), "guest never got ready: {:?}", m.out.text());
    // The guest now sits in HLT inside KVM: no exits until the interrupt.
    irq.write(1).expect("raise the interrupt");
    assert!(m.out.wait_for("RI"), "no interrupt delivered: {:?} {:?}", m.out.text(), shared.exit());
    irq.write(1).expect("raise it again");
    assert!(m.out.wait_for("RII"), "no second interrupt: {:?} {:?}", m.out.text(), shared.exit());
    shared.request(Target::Stop);
    handle.kick();
    handle.join();
    assert_eq!(shared.exit(), None, "stopping is not an exit of the guest's making");
}

#[test]
#[ignore = "needs /dev/kvm; cargo xtask test provides it"]
fn configured_vcpu_sees_normalized_cpuid() {
    #[rustfmt::skip]
    let code = [
        0xb8, 0x01, 0x00, 0x00, 0x00, // mov eax, 1
        0x31, 0xc9,                   // xor ecx, ecx
        0x0f, 0xa2,                   // cpuid
        0x89, 0xd8,                   // mov eax, ebx
        0xc1, 0xe8, 0x10,             // shr eax, 16: al = logical processors
        0x66, 0xba, 0xf8, 0x03,       // mov dx, 0x3f8
        0xee,                         // out dx, al
        0x89, 0xd8,                   // mov eax, ebx
        0xc1, 0xe8, 0x18,             // shr eax, 24: al = initial APIC id
        0xee,                         // out dx, al
        0x89, 0xc8,                   // mov eax, ecx
        0xc1, 0xe8, 0x18,             // shr eax, 24: bit 7 = hypervisor
        0xee,                         // out dx, al
        0xeb, 0xfe,                   // jmp $
    ];
    let m = machine(&code);
    regs::write_boot_tables(m.vm.memory()).expect("boot tables");
    let mut vcpu = m.vcpu();
    // CPUID, MSRs, registers, FPU and LINT pins as for a Linux boot.
    vcpu.configure(&m.vm, 4, EntryPoint::Pvh { entry: CODE, start_info: 0 }).expect("configured");
    for _ in 0..3 {
        assert_eq!(vcpu.run_once(), VcpuEvent::Continue);
    }
    let out = m.out.0.lock().expect("not poisoned").clone();
    assert_eq!(out[0], 4, "logical processors per package");
    assert_eq!(out[1], 0, "APIC id of vCPU 0");
    assert_eq!(out[2] & 0x80, 0x80, "hypervisor bit");
}

/// A device model that, when the guest writes to it, makes a system call
/// no vCPU thread needs — as a compromised device model would.
struct Subverted;

impl BusDevice for Subverted {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }
    fn write(&mut self, _offset: u64, _data: &[u8]) {
        eprintln!("device: opening a socket");
        // SAFETY: socket(2) with constant arguments; the vCPU filter kills
        // the process before it returns.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
        eprintln!("device: still alive, socket() = {fd}");
    }
}

#[test]
#[ignore = "needs /dev/kvm; cargo xtask test provides it"]
fn a_forbidden_syscall_from_a_vcpu_thread_kills_the_vmm() {
    if std::env::var_os("MOAT_SECCOMP_VCPU_CHILD").is_none() {
        let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
            .args(["--exact", "a_forbidden_syscall_from_a_vcpu_thread_kills_the_vmm", "--include-ignored"])
            .args(["--nocapture", "--test-threads", "1"])
            .env("MOAT_SECCOMP_VCPU_CHILD", "1")
            .output()
            .expect("child runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("device: opening a socket"), "{stderr}");
        assert!(!stderr.contains("still alive"), "{stderr}");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(out.status.signal(), Some(libc::SIGSYS), "{:?}\n{stderr}", out.status);
        return;
    }
    // The child: a real vCPU thread under the real vCPU filter; the guest
    // writes to port 0x80, where the subverted device sits.
    let code = [0xb0, 0x01, 0xe6, 0x80, 0xeb, 0xfe]; // mov al, 1; out 0x80, al; jmp $
    let vm = Vm::new(create_guest_memory(16 << 20).expect("guest memory")).expect("KVM VM");
    vm.memory().write_slice(&code, GuestAddress(CODE)).expect("code fits");
    let mut io = Bus::default();
    io.insert(Arc::new(Mutex::new(Subverted)), 0x80, 1).expect("free port");
    let vcpu = Vcpu::new(&vm, 0, Arc::new(io), Arc::new(Bus::default())).expect("vCPU");
    real_mode(&vcpu);
    let filter = moat_vmm::seccomp::filter(moat_vmm::seccomp::ThreadKind::Vcpu, moat_vmm::seccomp::Needs::NONE)
        .expect("filter builds");
    let shared = VcpuShared::new().expect("shared state");
    let start = StartGate::new();
    let _handle = vcpu.start(shared.clone(), Some(filter), start.clone()).expect("vCPU thread");
    start.open(true);
    // Bounded, so that a filter that fails to kill fails the test rather
    // than hanging it.
    std::thread::sleep(Duration::from_secs(30));
    eprintln!("device: still alive 30 s later; exit {:?}", shared.exit());
    std::process::exit(0);
}
